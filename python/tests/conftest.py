"""Shared paths for the Python tests: they run under Bazel (//python:python_test, from the
runfiles tree) or by hand from the repository root (`.venv/bin/python -m pytest python/tests`,
after `bazel build //python:pipec //tools:pipec //tools:piperun`)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


def example(name: str) -> str:
    return os.path.join(EXAMPLES, name)


def pipec_binary() -> str:
    for candidate in (os.path.join(ROOT, "tools", "pipec"),
                      os.path.join(ROOT, "bazel-bin", "tools", "pipec")):
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("tools/pipec is not built: bazel build //tools:pipec")


def run_pipec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([pipec_binary(), *args], capture_output=True, text=True, check=False)


@pytest.fixture
def uniform8() -> str:
    return example("uniform-8.json")
