"""Tests on the emulated device (kernels/cuda/emu/README.md), in both of its modes."""

load("//:copts.bzl", "PIPE_COPTS")
load("//third_party/cuda:cuda.bzl", "cuda_cc_test")

def emulated_tests(name, async_name, srcs, deps, size = "medium", env = {}):
    """Declares `name` (synchronous streams) and `async_name` (PIPEC_EMU_ASYNC=1: every stream a
    worker thread, so a missing cross-stream wait shows), both with `env`. Only where the CUDA
    toolkit is."""
    for test_name, mode in [(name, {}), (async_name, {"PIPEC_EMU_ASYNC": "1"})]:
        cuda_cc_test(
            name = test_name,
            size = size,
            srcs = srcs,
            copts = PIPE_COPTS,
            env = dict(env, **mode),
            deps = deps,
        )
