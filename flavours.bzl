"""Backend flavours: one declaration per CUDA target, built for each device it runs on.

The cuda backend and its ops run on three devices, so a target that holds or links CUDA code
exists in up to three flavours, each a Bazel target named after its declaration plus the
flavour's suffix (docs/gpu.md, "Build flavours"):

    flavour     suffix         the CUDA ops and runtime                            runs
    gpu         ""             .cu kernels through nvcc, cuBLASLt, libcudart, NCCL  on a GPU
    emu         "_emu"         the emulated device (kernels/cuda/emu/README.md):    in CI
                               fake CUDA runtime and NCCL, CPU stand-ins for the
                               kernels
    kernel_emu  "_kernel_emu"  the emulated device with the .cu kernels themselves  in CI
                               on the kernel emulator (matmuls on the CPU)

The macros below declare every flavour of a target from one description. `deps` are the same in
every flavour; `flavoured_deps` name flavoured targets and get the flavour's suffix (":cuda_ops"
is ":cuda_ops_emu" in the emu flavour); `flavour_srcs`, `flavour_hdrs` and `flavour_deps` add
what one flavour alone needs, by flavour name. Every flavour links its CUDA runtime (libcudart
on a GPU, //kernels:fake_cuda_runtime on the emulated device), and the emulated ones are
compiled with PIPEC_EMULATED_DEVICE defined. Like every CUDA target, a flavour is declared only
where the toolkit is (//third_party/cuda:cuda_configure.bzl), so a BUILD file may use these
unconditionally.

Tests (cuda_test) are tagged requires-gpu in the gpu flavour; in the kernel_emu flavour every
launch runs its grid's blocks in a new order (PIPEC_EMU_BLOCK_ORDER=shuffled), as a GPU may;
the flavours named in `async_flavours` also get an "_async" variant whose streams are worker
threads (PIPEC_EMU_ASYNC=1), so that a missing cross-stream wait shows.
"""

load("@local_config_cuda//:defs.bzl", "HAS_CUDA")
load("//:copts.bzl", "PIPE_COPTS")
load("//kernels:emulated.bzl", "emulated_cuda_library")
load("//third_party/cuda:cuda.bzl", "CUDA_ARCHS", "cuda_library")

ALL_FLAVOURS = ["gpu", "emu", "kernel_emu"]

# Where NCCL is, a GPU's or the emulated one (//runtime:nccl): the kernel emulator has none.
NCCL_FLAVOURS = ["gpu", "emu"]

# Where the .cu kernels themselves run: on a GPU, and on the kernel emulator.
KERNEL_FLAVOURS = ["gpu", "kernel_emu"]

_SUFFIX = {
    "gpu": "",
    "emu": "_emu",
    "kernel_emu": "_kernel_emu",
}

# The CUDA runtime every flavour links.
_RUNTIME_DEPS = {
    "gpu": ["@cuda//:cudart"],
    "emu": [
        "//kernels:fake_cuda_runtime",
        "@cuda//:cuda_headers",
    ],
    "kernel_emu": [
        "//kernels:fake_cuda_runtime",
        "@cuda//:cuda_headers",
    ],
}

_DEFINES = {
    "gpu": [],
    "emu": ["PIPEC_EMULATED_DEVICE"],
    "kernel_emu": ["PIPEC_EMULATED_DEVICE"],
}

# What a test sees of its device, by flavour.
_TEST_ENV = {
    "gpu": {},
    "emu": {},
    "kernel_emu": {"PIPEC_EMU_BLOCK_ORDER": "shuffled"},
}

def flavoured(label, flavour):
    """`label`, a flavoured target, in `flavour`."""
    return label + _SUFFIX[flavour]

def _pick(value, flavour):
    """`value`, or its entry for `flavour` where it is a dict by flavour."""
    if type(value) == "dict":
        return value.get(flavour)
    return value

def _unique(labels):
    seen = {}
    for label in labels:
        seen[label] = True
    return seen.keys()

def _deps(flavour, deps, flavoured_deps, flavour_deps):
    return _unique(
        deps + [flavoured(d, flavour) for d in flavoured_deps] +
        flavour_deps.get(flavour, []) + _RUNTIME_DEPS[flavour],
    )

def cuda_flavoured_library(
        name,
        flavours = ALL_FLAVOURS,
        srcs = [],
        hdrs = [],
        deps = [],
        flavoured_deps = [],
        flavour_srcs = {},
        flavour_hdrs = {},
        flavour_deps = {},
        copts = PIPE_COPTS,
        local_defines = [],
        **kwargs):
    """A cc_library of host code in each of `flavours`."""
    if not HAS_CUDA:
        return
    for flavour in flavours:
        native.cc_library(
            name = flavoured(name, flavour),
            srcs = srcs + flavour_srcs.get(flavour, []),
            hdrs = hdrs + flavour_hdrs.get(flavour, []),
            copts = copts,
            local_defines = local_defines + _DEFINES[flavour],
            deps = _deps(flavour, deps, flavoured_deps, flavour_deps),
            **kwargs
        )

def cuda_kernel_library(
        name,
        srcs,
        hdrs = [],
        textual_hdrs = [],
        deps = [],
        flavoured_deps = [],
        stand_in_srcs = [],
        stand_in_deps = [],
        archs = CUDA_ARCHS,
        src_archs = {},
        **kwargs):
    """The .cu kernels `srcs` behind `hdrs`: through nvcc in the gpu flavour (for `archs`, or
    `src_archs[file]`), compiled for the kernel emulator in the kernel_emu flavour; and, with
    `stand_in_srcs` (host code implementing the same `hdrs`, with `stand_in_deps`), an emu
    flavour of CPU stand-ins. `flavoured_deps` must exist in each flavour declared."""
    if not HAS_CUDA:
        return
    cuda_library(
        name = name,
        srcs = srcs,
        hdrs = hdrs,
        textual_hdrs = textual_hdrs,
        archs = archs,
        src_archs = src_archs,
        deps = deps + [flavoured(d, "gpu") for d in flavoured_deps],
        **kwargs
    )
    emulated_cuda_library(
        name = flavoured(name, "kernel_emu"),
        srcs = srcs,
        hdrs = hdrs,
        textual_hdrs = textual_hdrs,
        deps = _deps("kernel_emu", deps + ["//kernels:kernel_emulator"], flavoured_deps, {}),
        **kwargs
    )
    if stand_in_srcs:
        native.cc_library(
            name = flavoured(name, "emu"),
            srcs = stand_in_srcs,
            hdrs = hdrs,
            copts = PIPE_COPTS,
            local_defines = _DEFINES["emu"],
            deps = _deps("emu", deps + stand_in_deps, flavoured_deps, {}),
            **kwargs
        )

def cuda_test(
        name,
        srcs,
        flavours = ALL_FLAVOURS,
        async_flavours = [],
        deps = [],
        flavoured_deps = [],
        flavour_srcs = {},
        flavour_deps = {},
        args = [],
        env = {},
        flavour_env = {},
        size = "small",
        shard_count = None,
        tags = [],
        **kwargs):
    """A cc_test in each of `flavours` (and an "_async" variant of those in `async_flavours`).
    `args`, `size` and `shard_count` may be given by flavour (a dict).

    Each flavour's sources are compiled once, into the testonly library NAME_FLAVOUR_lib
    (`name` + the flavour's suffix + "_lib", alwayslink), which that flavour's test and its
    "_async" variant link: the two differ only in their environment. Another declaration that
    runs the same sources in the same flavour with other args or env links that library too
    (`srcs = []`, `deps = [":NAME_FLAVOUR_lib"]`) instead of compiling them again."""
    if not HAS_CUDA:
        return
    for flavour in flavours:
        library = flavoured(name, flavour) + "_lib"
        native.cc_library(
            name = library,
            testonly = True,
            srcs = srcs + flavour_srcs.get(flavour, []),
            copts = PIPE_COPTS,
            local_defines = _DEFINES[flavour],
            alwayslink = True,
            deps = _deps(flavour, deps, flavoured_deps, flavour_deps),
        )
        modes = [("", {})]
        if flavour in async_flavours:
            modes.append(("_async", {"PIPEC_EMU_ASYNC": "1"}))
        for mode, mode_env in modes:
            test_env = dict(_TEST_ENV[flavour])
            test_env.update(env)
            test_env.update(flavour_env.get(flavour, {}))
            test_env.update(mode_env)
            native.cc_test(
                name = flavoured(name, flavour) + mode,
                args = _pick(args, flavour) or [],
                env = test_env,
                shard_count = _pick(shard_count, flavour),
                size = _pick(size, flavour) or "small",
                tags = tags + (["requires-gpu"] if flavour == "gpu" else []),
                deps = [":" + library],
                **kwargs
            )

def cuda_flavoured_binary(
        name,
        srcs,
        flavours = ["gpu"],
        deps = [],
        flavoured_deps = [],
        flavour_deps = {},
        cpu_fallback = False,
        **kwargs):
    """A cc_binary in each of `flavours`, compiled with PIPEC_HAS_CUDA defined. With
    `cpu_fallback`, the gpu flavour exists without CUDA too: `deps` alone, without
    PIPEC_HAS_CUDA (piperun's cpu backend)."""
    if not HAS_CUDA:
        if cpu_fallback:
            native.cc_binary(name = name, srcs = srcs, copts = PIPE_COPTS, deps = deps, **kwargs)
        return
    for flavour in flavours:
        native.cc_binary(
            name = flavoured(name, flavour),
            srcs = srcs,
            copts = PIPE_COPTS,
            local_defines = ["PIPEC_HAS_CUDA"] + _DEFINES[flavour],
            deps = _deps(flavour, deps, flavoured_deps, flavour_deps),
            **kwargs
        )

def cuda_bench(
        name,
        srcs,
        deps = [],
        flavoured_deps = [],
        flavour_deps = {},
        smoke_flavour = "emu",
        smoke_runs = {"test": []},
        smoke_env = {},
        smoke_size = "small",
        **kwargs):
    """A benchmark: the gpu flavour's cc_binary `name` (tag requires-gpu), and for each entry
    (key: args) of `smoke_runs` a short run of it in `smoke_flavour`, the cc_test
    name + the flavour's suffix + "_" + key, so that CI catches a benchmark that would fail on
    the GPU machine (its timings mean nothing). `smoke_size` may be given by key (a dict)."""
    if not HAS_CUDA:
        return
    native.cc_binary(
        name = name,
        srcs = srcs,
        copts = PIPE_COPTS,
        tags = ["requires-gpu"],
        deps = _deps("gpu", deps, flavoured_deps, flavour_deps),
        **kwargs
    )
    for key, args in smoke_runs.items():
        test_env = dict(_TEST_ENV[smoke_flavour])
        test_env.update(smoke_env)
        native.cc_test(
            name = flavoured(name, smoke_flavour) + "_" + key,
            size = _pick(smoke_size, key) or "small",
            srcs = srcs,
            args = args,
            copts = PIPE_COPTS,
            env = test_env,
            local_defines = _DEFINES[smoke_flavour],
            deps = _deps(smoke_flavour, deps, flavoured_deps, flavour_deps),
            **kwargs
        )
