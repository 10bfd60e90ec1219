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


def run_ranks(fn, world: int, args: tuple, what: str = "ranks") -> None:
    """fn(rank, *args) in `world` forked processes, failing the test on an error or after
    600 s (a hang fails here, not at Bazel's timeout). Forked, not spawned: the ranks inherit
    the imported torch and pipec instead of importing them again (seconds per process);
    callers fork before starting any thread pool or process group."""
    import time  # noqa: PLC0415

    import torch.multiprocessing as mp  # noqa: PLC0415
    ranks = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + 600
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the {world} {what} did not finish within 600 s")


def run_pipec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([pipec_binary(), *args], capture_output=True, text=True, check=False)


@pytest.fixture
def uniform8() -> str:
    return example("uniform-8.json")
