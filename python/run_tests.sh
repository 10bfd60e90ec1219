#!/usr/bin/env bash
# //python:python_test: the Python tests (python/tests) under pytest, with the project's virtual
# environment (.venv, made by tools/setup.sh with the pinned PyTorch), importing the pipec
# package and its extension from this test's runfiles. pytest's JUnit XML goes where Bazel
# reads test cases from, so tools/test.sh counts each Python test.
set -euo pipefail
# The runfiles are links into the source tree: follow one back to find the repository's .venv.
root="$(cd "$(dirname "$(readlink -f python/pipec/__init__.py)")/../.." && pwd)"
python="$root/.venv/bin/python"
if [ ! -x "$python" ]; then
  echo "python_test: $python is missing; run: bash tools/setup.sh" >&2
  exit 1
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export GLOO_SOCKET_IFNAME=lo
exec "$python" -m pytest -q -p no:cacheprovider python/tests \
  --junitxml="${XML_OUTPUT_FILE:-$TEST_TMPDIR/pytest.xml}" -o junit_family=xunit2 \
  --basetemp="$TEST_TMPDIR/pytest" "$@"
