"""piperun --data with NumPy .npy token files written by NumPy itself (np.save): every integer
dtype and shape NumPy writes gives the same tokens, and so the same losses, as the raw uint16
file of the same ids; what is not a C-ordered array of in-vocabulary integer ids is refused
with one line naming the file."""

import re
import subprocess

import pytest

from conftest import example, run_pipec
from test_init_from import piperun_binary

np = pytest.importorskip("numpy")

VOCAB = 64  # examples/tiny-gpt.json


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "p.json"
    r = run_pipec("compile", "--model", example("tiny-gpt.json"), "--schedule", "1f1b",
                  "--pp", "2", "--microbatches", "4", "-o", str(path), "--quiet")
    assert r.returncode == 0, r.stderr
    return str(path)


def losses(plan: str, data: str) -> list:
    r = subprocess.run([piperun_binary(), plan, "--backend", "cpu", "--steps", "2", "--data",
                        data], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    return re.findall(r"^step \d+ loss (\S+)$", r.stdout, re.M)


def ids(count: int) -> "np.ndarray":
    return (np.arange(count, dtype=np.int64) * 7 + 3) % VOCAB


def test_npy_of_every_integer_dtype_and_shape_reads_as_the_raw_file(plan, tmp_path):
    raw = tmp_path / "ids.bin"
    ids(600).astype("<u2").tofile(raw)
    want = losses(plan, str(raw))
    assert len(want) == 2
    for dtype, shape in [("uint16", (600,)), ("int64", (600,)), ("uint8", (20, 30)),
                         ("int32", (2, 3, 100)), ("uint32", (600, 1)), ("int16", (600,))]:
        path = tmp_path / f"ids-{dtype}.npy"
        np.save(path, ids(600).astype(dtype).reshape(shape))
        assert losses(plan, str(path)) == want, (dtype, shape)


def run_bad(plan: str, path) -> str:
    r = subprocess.run([piperun_binary(), plan, "--backend", "cpu", "--data", str(path)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    return r.stderr


@pytest.mark.parametrize("array, message", [
    (lambda: ids(600).astype(np.float32), "dtype '<f4' is not one of token ids"),
    (lambda: ids(600).astype(">u4"), "dtype '>u4' is not one of token ids"),
    (lambda: np.asfortranarray(ids(600).reshape(20, 30)), "fortran_order True"),
    (lambda: np.where(np.arange(600) == 17, -1, ids(600)), "token -1 at position 17"),
    (lambda: np.where(np.arange(600) == 5, VOCAB, ids(600)), f"token {VOCAB} at position 5"),
    (lambda: ids(4), "4 tokens, fewer than one sequence"),
])
def test_npy_that_is_not_token_ids_is_refused_naming_the_file(plan, tmp_path, array, message):
    path = tmp_path / "bad.npy"
    np.save(path, array())
    err = run_bad(plan, path)
    assert message in err and "bad.npy" in err, err


def test_truncated_npy_is_refused_with_the_byte_counts(plan, tmp_path):
    path = tmp_path / "cut.npy"
    np.save(path, ids(600).astype(np.uint16))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    assert "needs 1200 bytes of data but the file has 1190" in run_bad(plan, path)
