#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build and test pipec (docs/testing.md).
# Idempotent: does nothing when every package is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(bazel-bootstrap bazel-platforms nlohmann-json3-dev libfmt-dev llvm-14-dev
          libgtest-dev libbenchmark-dev g++ zlib1g-dev libtinfo-dev
          python3-dev python3-venv pybind11-dev)
# The figure test reads pipec's SVG with libxml2 and renders it with librsvg's rsvg-convert.
packages+=(libxml2-dev librsvg2-bin)
# Sanitizer builds and fuzz targets (--config=asan) use clang.
packages+=(clang-14 libclang-rt-14-dev lld-14)
# The format check (tools/check_format.sh, run by tools/test.sh).
packages+=(clang-format-14)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The Python side (docs/pytorch.md): a project-local virtual environment, .venv, made from
# Debian's Python (the one //python's extension is built for) with the pinned PyTorch of
# tools/torch-requirements.txt (a 2.49 GB download) and the pinned Hugging Face transformers of
# tools/hf-requirements.txt (30 MB), installed only when either file changed since the last
# install. A failure here leaves the C++ side usable; //python:python_test then fails and says
# why.
venv=.venv
requirements=(tools/torch-requirements.txt tools/hf-requirements.txt)
stamp="$venv/.pipec-requirements.sha256"
want=$(cat "${requirements[@]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the pinned PyTorch and transformers into $venv (a 2.52 GB download)" >&2
  ok=1
  { [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"; } || ok=0
  for r in "${requirements[@]}"; do
    [ $ok = 1 ] && "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      --no-deps --require-hashes --only-binary=:all: -r "$r" || ok=0
  done
  if [ $ok = 1 ]; then
    echo "$want" >"$stamp"
  else
    echo "setup: warning: could not install PyTorch and transformers into $venv; the Python" \
      "tests will fail" >&2
  fi
fi
# `import pipec` in .venv finds python/pipec (and, from there, the extension in bazel-bin).
if [ -x "$venv/bin/python" ]; then
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$PWD/python" >"$site/pipec.pth"
fi
