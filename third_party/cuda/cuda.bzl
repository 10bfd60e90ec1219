"""Our CUDA rules: .cu files through nvcc into a static library that cc_* targets depend on.

Every macro here declares nothing unless @local_config_cuda says the toolkit exists, so a BUILD
file can use them unconditionally and still load (and build //...) on a machine without CUDA:

    cuda_library(name = "k", srcs = ["K.cu"], hdrs = ["K.h"])   # nvcc, then a cc_library
    cuda_cc_library / cuda_cc_test / cuda_cc_binary             # plain cc_* rules, CUDA-only

cuda_library runs one genrule: nvcc -c per .cu file, then `ar rcs`; the archive is the srcs of a
cc_library that also carries the headers and links libcudart. No relocatable device code, so no
device-link step is needed. Each .cu file becomes a fat binary for the GPUs of CUDA_ARCHS:

    sm_80       SASS for compute capability 8.x (A100, and the 8.6 and 8.9 GPUs run it too)
    sm_90a      SASS for 9.0 (H100, H200) with Hopper's own instructions (wgmma)
    compute_90  PTX, which a newer GPU's driver compiles at load time

A file whose kernels use sm_90a's own instructions is compiled for HOPPER_ARCHS alone
(`src_archs`): its kernels then exist on a 9.0 GPU only, and the launchers must choose them
there alone (kernels/cuda/Launch.h, Target).
"""

load("@local_config_cuda//:defs.bzl", "CUDA_PATH", "HAS_CUDA")

NVCC_FLAGS = [
    "-O3",
    "-std=c++20",
    "-Xcompiler -fPIC",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    # Warnings are errors, as in copts.bzl: nvcc's own and the host compiler's.
    "-Werror all-warnings",
    "-Xcompiler -Werror",
]

# The code every .cu file is built into (one binary for A100s and H100s/H200s).
CUDA_ARCHS = ["sm_80", "sm_90a", "compute_90"]

# The code of files that use sm_90a's own instructions (wgmma): a 9.0 GPU's alone.
HOPPER_ARCHS = ["sm_90a"]

def _gencode(arch):
    """nvcc's -gencode for "sm_XX" (SASS, from compute_XX) or "compute_XX" (PTX)."""
    if arch.startswith("sm_"):
        return "-gencode arch=compute_%s,code=%s" % (arch[len("sm_"):], arch)
    return "-gencode arch=%s,code=%s" % (arch, arch)

def if_cuda(if_true, if_false = []):
    """Selects a value by whether the CUDA toolkit was found at configure time."""
    return if_true if HAS_CUDA else if_false

def cuda_library(
        name,
        srcs,
        hdrs = [],
        textual_hdrs = [],
        deps = [],
        nvcc_flags = [],
        archs = CUDA_ARCHS,
        src_archs = {},
        **kwargs):
    """Compiles `srcs` (.cu) with nvcc into lib<name>.a wrapped as cc_library `name`.

    `hdrs` are the library's public headers; `textual_hdrs` are headers the .cu files include
    that are not exported (both are visible to nvcc). Includes are relative to the workspace
    root, as for cc_library. Every file is compiled for `archs`, or for `src_archs[file]` where
    that names it (HOPPER_ARCHS for a file of sm_90a kernels). Declares nothing without CUDA.
    """
    if not HAS_CUDA:
        return
    archive = "lib%s_nvcc.a" % name
    compiles = []
    for src in srcs:
        obj = "$$objs/%s.o" % src.replace("/", "_").replace(".cu", "")
        gencodes = [_gencode(arch) for arch in src_archs.get(src, archs)]
        compiles.append(" ".join(
            ["%s/bin/nvcc" % CUDA_PATH] + NVCC_FLAGS + gencodes + nvcc_flags +
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
