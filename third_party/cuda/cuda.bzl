"""Our CUDA rules: .cu files through nvcc into a static library that cc_* targets depend on.

Every macro here declares nothing unless @local_config_cuda says the toolkit exists, so a BUILD
file can use them unconditionally and still load (and build //...) on a machine without CUDA:

    cuda_library(name = "k", srcs = ["K.cu"], hdrs = ["K.h"])   # nvcc, then a cc_library
    cuda_cc_library / cuda_cc_test / cuda_cc_binary             # plain cc_* rules, CUDA-only

cuda_library runs one genrule: nvcc -c per .cu file (sm_90a SASS plus compute_90 PTX, so newer
GPUs JIT it), then `ar rcs`; the archive is the srcs of a cc_library that also carries the
headers and links libcudart. No relocatable device code, so no device-link step is needed.
"""

load("@local_config_cuda//:defs.bzl", "CUDA_PATH", "HAS_CUDA")

NVCC_FLAGS = [
    "-O3",
    "-std=c++20",
    # sm_90a: Hopper's own instructions (wgmma) for the attention forward; the compute_90 PTX
    # (without them) is what newer GPUs JIT, where the launchers pick other kernels.
    "-gencode arch=compute_90a,code=sm_90a",
    "-gencode arch=compute_90,code=compute_90",
    "-Xcompiler -fPIC",
    "--expt-relaxed-constexpr",
    "-lineinfo",
]

def if_cuda(if_true, if_false = []):
    """Selects a value by whether the CUDA toolkit was found at configure time."""
    return if_true if HAS_CUDA else if_false

def cuda_library(name, srcs, hdrs = [], textual_hdrs = [], deps = [], nvcc_flags = [], **kwargs):
    """Compiles `srcs` (.cu) with nvcc into lib<name>.a wrapped as cc_library `name`.

    `hdrs` are the library's public headers; `textual_hdrs` are headers the .cu files include
    that are not exported (both are visible to nvcc). Includes are relative to the workspace
    root, as for cc_library. Declares nothing without CUDA.
    """
    if not HAS_CUDA:
        return
    archive = "lib%s_nvcc.a" % name
    compiles = []
    for src in srcs:
        obj = "$$objs/%s.o" % src.replace("/", "_").replace(".cu", "")
        compiles.append(" ".join(
            ["%s/bin/nvcc" % CUDA_PATH] + NVCC_FLAGS + nvcc_flags +
            ["-I.", "-I$(GENDIR)", "-c", "$(location %s)" % src, "-o", obj],
        ))
    cmd = " && ".join(
        ["objs=$$(mktemp -d)"] + compiles + [
            "ar rcs $@ $$objs/*.o",
            "rm -rf $$objs",
        ],
    )
    native.genrule(
        name = name + "_nvcc",
        srcs = srcs + hdrs + textual_hdrs,
        outs = [archive],
        cmd = cmd,
        message = "nvcc %s" % name,
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        srcs = [archive],
        hdrs = hdrs,
        textual_hdrs = textual_hdrs,
        linkstatic = True,
        deps = deps + ["@cuda//:cudart"],
        **kwargs
    )

def cuda_cc_library(**kwargs):
    """A cc_library declared only where CUDA exists (e.g. host code calling cuBLAS)."""
    if HAS_CUDA:
        native.cc_library(**kwargs)

def cuda_cc_test(**kwargs):
    """A cc_test declared only where CUDA exists; tag it requires-gpu if it needs a device."""
    if HAS_CUDA:
        native.cc_test(**kwargs)

def cuda_cc_binary(**kwargs):
    """A cc_binary declared only where CUDA exists."""
    if HAS_CUDA:
        native.cc_binary(**kwargs)
