"""The kernel emulator's build rule (kernels/cuda/emu/README.md), for any package with .cu files.

    emulated_cuda_library(name = "k_emu", srcs = ["cuda/K.cu"], hdrs = ["cuda/K.h"], deps = [...])

compiles each .cu file, unchanged, for the host: a generated unit holds the emulator's prelude
(kernels/cuda/emu/KernelEmu.h) and then the file (with #line, so messages name the .cu file).
The result is a cc_library, declared only where the CUDA toolkit is (the prelude needs its
headers); dependents link it instead of the nvcc library.
"""

load("@local_config_cuda//:defs.bzl", "HAS_CUDA")
load("//:copts.bzl", "PIPE_COPTS")

# Optimised even in fastbuild: the emulated threads run the kernels' loops. Device code
# reinterprets bf16 storage as wider words, as nvcc allows: no strict aliasing. A misaligned
# access faults on a GPU, not on x86: -fsanitize=alignment makes it fault here.
EMULATED_COPTS = PIPE_COPTS + [
    "-O2",
    "-fno-strict-aliasing",
    "-Wno-unknown-pragmas",
    "-fsanitize=alignment",
    "-fno-sanitize-recover=alignment",
]

def emulated_cuda_library(name, srcs, extra_srcs = [], deps = [], **kwargs):
    """`srcs`: .cu files of this package; `extra_srcs`: host sources built with the same options."""
    if not HAS_CUDA:
        return
    generated = []
    for src in srcs:
        out = "emulated/%s" % src.replace(".cu", "Emu.cpp")
        native.genrule(
            name = "%s_%s" % (name, src.replace("/", "_").replace(".cu", "")),
            srcs = [src],
            outs = [out],
            cmd = "(printf '#include \"kernels/cuda/emu/KernelEmu.h\"\\n#line 1 \"%s/%s\"\\n'; cat $<) > $@" %
                  (native.package_name(), src),
            visibility = ["//visibility:private"],
        )
        generated.append(out)
    native.cc_library(
        name = name,
        srcs = generated + extra_srcs,
        copts = EMULATED_COPTS,
        linkopts = ["-fsanitize=alignment"],
        deps = deps,
        **kwargs
    )
