"""Fuzz targets (tests/fuzz): each is a test in both builds.

    pipec_fuzz_test(name = "plan_fuzzer", src = "PlanFuzzer.cpp", deps = [...], seeds = [...])

declares `name`_bin, the target linked with ReplayMain.cpp (//tests/fuzz:replay_main, compiled
once for all of them) in the normal build and with
libFuzzer's main under --config=asan (define pipec_fuzz=libfuzzer), and the test `name`, which
runs the seeds once (normal build) or fuzzes from them for PIPEC_FUZZ_SECONDS (asan).

A target's seeds are `seeds` and, always, the files of seeds/NAME/ (NAME without "_fuzzer")
and regressions/NAME-* (the inputs its campaigns found, once fixed), which campaign.sh uses
too: a new target is one line,

    pipec_fuzz_test(name = "costs_fuzzer", src = "CostsFuzzer.cpp", deps = ["//ir"])

with its seeds in seeds/costs/.
"""

load("//:copts.bzl", "PIPE_COPTS")

def pipec_fuzz_test(name, src, deps, seeds = [], plans = None, size = "medium"):
    """`plans`: a name prefix of tests/fuzz/seed_plans.txt ("" for all) to add as seeds."""
    short = name[:-len("_fuzzer")] if name.endswith("_fuzzer") else name
    seeds = seeds + native.glob(
        ["seeds/%s/*" % short, "regressions/%s-*" % short],
        allow_empty = True,
    )
    native.cc_binary(
        name = name + "_bin",
        testonly = True,
        srcs = [src, "FuzzTarget.h", "TinyHfModels.h"],
        copts = PIPE_COPTS,
        linkopts = select({
            ":libfuzzer": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        deps = deps + ["@llvm//:support"] + select({
            ":libfuzzer": [],
            "//conditions:default": ["//tests/fuzz:replay_main"],
        }),
    )
    native.sh_test(
        name = name,
        size = size,
        srcs = ["run_fuzzer.sh"],
        args = select({
            ":libfuzzer": ["fuzz"],
            "//conditions:default": ["replay"],
        }) + [
            "$(rootpath :%s_bin)" % name,
            "$(rootpath :pipec.dict)",
        ] + (["--plans", plans or "''"] if plans != None else []) +
               ["$(rootpaths %s)" % s for s in seeds],
        data = [
            ":%s_bin" % name,
            ":pipec.dict",
        ] + seeds + ([
            ":seed_plans.txt",
            "//examples:models",
            "//tools:pipec",
        ] if plans != None else []),
    )
