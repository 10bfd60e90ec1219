#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build and test pipec (DESIGN §9).
# Idempotent: does nothing when every package is already there.
set -euo pipefail
packages=(bazel-bootstrap bazel-platforms nlohmann-json3-dev libfmt-dev llvm-14-dev
          libgtest-dev libbenchmark-dev g++ zlib1g-dev libtinfo-dev)
# The figure test reads pipec's SVG with libxml2 and renders it with librsvg's rsvg-convert.
packages+=(libxml2-dev librsvg2-bin)
# Sanitizer builds and fuzz targets (--config=asan) use clang.
packages+=(clang-14 libclang-rt-14-dev lld-14)
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
