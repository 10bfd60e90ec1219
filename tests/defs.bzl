"""The rule of the tests that are not CUDA tests (those are //:flavours.bzl's cuda_test).

    pipec_test(name = "verifier_test", srcs = ["VerifierTest.cpp"], deps = [":test_util"])

is a cc_test of PIPE_COPTS linked with GoogleTest's main, of Bazel's default size (medium) unless
`size` says otherwise. A suite with `goldens` (files of tests/golden, its data) compares with them
through tests/Golden.h, whose goldenMain is its main (GoogleTest without its main), and reads
them from --golden_dir=tests/golden. With `needs_cuda`, the test is declared only where the CUDA
toolkit is (//third_party/cuda), like cuda_cc_test. Every other attribute (data, args,
shard_count, linkopts ...) is cc_test's.
"""

load("//:copts.bzl", "PIPE_COPTS")
load("//third_party/cuda:cuda.bzl", "cuda_cc_test")

# A test's data for running the commands on the shipped examples (tests/Command.h).
COMMANDS = [
    "//examples:models",
    "//tools:pipec",
    "//tools:piperun",
]

def pipec_test(
        name,
        srcs,
        deps = [],
        goldens = None,
        data = [],
        args = [],
        needs_cuda = False,
        **kwargs):
    if goldens != None:
        data = goldens + data
        args = ["--golden_dir=tests/golden"] + args
    rule = cuda_cc_test if needs_cuda else native.cc_test
    rule(
        name = name,
        srcs = srcs,
        args = args,
        copts = PIPE_COPTS,
        data = data,
        deps = deps + (["@gtest//:gtest_main"] if goldens == None else ["//tests:golden", "@gtest"]),
        **kwargs
    )
