"""The wheel (//python:wheel) as a user installs it: `pip install` into a fresh Python 3.11
environment, offline and without dependencies, then, from a directory outside the repository,
the README's Python example, the installed `pipec compile` and `piperun` commands; without torch
(pipec alone) and with the project's pinned torch visible (pipec.torch imports)."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from conftest import ROOT, example


def wheel() -> str:
    found = (glob.glob(os.path.join(ROOT, "python", "pipec-*.whl")) or
             glob.glob(os.path.join(ROOT, "bazel-bin", "python", "pipec-*.whl")))
    if not found:
        raise FileNotFoundError("the wheel is not built: bazel build //python:wheel")
    return found[0]


def fresh_env(path, see_torch: bool) -> str:
    """A new environment from Debian's Python 3.11 with the wheel installed; returns its bin/."""
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(path)], check=True)
    if see_torch:  # the project's pinned torch (and numpy) without downloading them again
        site = subprocess.run([str(path / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        torch_site = os.path.dirname(os.path.dirname(__import__("torch").__file__))
        with open(os.path.join(site, "project-torch.pth"), "w") as f:
            f.write(torch_site + "\n")
    r = subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--no-index", "--no-deps", "--disable-pip-version-check", wheel()],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(path / "bin")


README_EXAMPLE = """
import pipec
def test_1f1b_bubble():  # a unit test of your own: (p-1)/(m+p-1)
    assert abs(pipec.compile("examples/uniform-8.json", "1f1b", pp=4, microbatches=8).stats.bubble_ratio - 3 / 11) < 1e-12
test_1f1b_bubble()
print(pipec.__file__)
"""


def outside(tmp_path):
    """A working directory with the README's example files and nothing of the repository."""
    work = tmp_path / "work"
    (work / "examples").mkdir(parents=True)
    for name in ("uniform-8.json", "tiny-gpt.json"):
        shutil.copy(example(name), work / "examples" / name)
    return work


@pytest.mark.parametrize("see_torch", [False, True])
def test_wheel_installs_and_runs_outside_the_repository(tmp_path, see_torch):
    bin_dir = fresh_env(tmp_path / "env", see_torch)
    work = outside(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run([os.path.join(bin_dir, "python"), "-c", README_EXAMPLE], cwd=work,
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(tmp_path / "env")), r.stdout  # the wheel's pipec
    r = subprocess.run([os.path.join(bin_dir, "pipec"), "compile", "--model",
                        "examples/tiny-gpt.json", "--schedule", "1f1b", "--pp", "2",
                        "--microbatches", "4", "-o", "tiny.json", "--quiet"],
                       cwd=work, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([os.path.join(bin_dir, "piperun"), "tiny.json", "--backend", "cpu",
                        "--steps", "2", "--check-reference"], cwd=work, capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 1 loss" in r.stdout
    r = subprocess.run([os.path.join(bin_dir, "python"), "-c", "import pipec.torch"], cwd=work,
                       capture_output=True, text=True, env=env)
    if see_torch:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode != 0 and "torch" in r.stderr, r.stderr
