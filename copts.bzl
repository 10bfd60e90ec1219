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
]
