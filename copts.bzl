"""Compiler options shared by every target (defined once, abseil style). Warnings are errors."""

PIPE_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
    "-Wno-deprecated-enum-enum-conversion",
]
