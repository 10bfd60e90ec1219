"""Compiler options shared by every target (defined once, abseil style)."""

PIPE_COPTS = [
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-deprecated-enum-enum-conversion",
]
