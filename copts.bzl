"""Compiler options shared by every target (defined once, abseil style). Warnings are errors."""

PIPE_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
    "-Wno-deprecated-enum-enum-conversion",
    # gcc 12 at -O2 reports std::string's own memcpy in operator+ as overlapping (gcc bug
    # 105651, a false positive); -c opt builds (benchmarks, the GPU check) would fail on it.
    "-Wno-restrict",
] + select({
    # fastbuild, what `bazel test` builds, at -O1 rather than -O0: about 15% longer to compile
    # and about ten times faster to run for the compiler's suites (calibration_test: 134 s at
    # -O0, 11 s at -O1), which keeps CI's test run short. -c dbg stays at -O0 for debugging;
    # -c opt keeps its -O2. The layering check only compiles: at -O0 (a third faster there).
    "//:fastbuild": ["-O1"],
    "//:fastbuild_layering": [],
    "//conditions:default": [],
})
