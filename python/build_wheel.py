"""Builds pipec's wheel (//python:wheel): the Python package, its extension and the pipec and
piperun commands, as pip installs them: the package under site-packages, the commands in the
environment's bin/ (the wheel's .data/scripts). Tags come from the extension's file name (built
for Debian 12's CPython, so cp311-cp311) and the machine (linux_x86_64: the commands link the
system's libstdc++, libfmt and, where CUDA was found at build time, /usr/local/cuda's libraries,
so the wheel is for the machine kind it was built on, not a manylinux one).

    build_wheel.py --version V --out DIR/pipec-V-TAG.whl --ext _pipec.cpython-311-...so
                   --script pipec --script piperun PACKAGE_FILE.py ...
"""

import argparse
import base64
import hashlib
import os
import re
import stat
import sys
import zipfile


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--version", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ext", required=True)
    p.add_argument("--script", action="append", default=[])
    p.add_argument("sources", nargs="+")
    a = p.parse_args()
    m = re.match(r"_pipec\.cpython-(\d+)-x86_64-linux-gnu\.so$", os.path.basename(a.ext))
    if not m:
        print(f"build_wheel: unexpected extension name {a.ext}", file=sys.stderr)
        return 2
    tag = f"cp{m.group(1)}-cp{m.group(1)}-linux_x86_64"
    want = f"pipec-{a.version}-{tag}.whl"
    if os.path.basename(a.out) != want:
        print(f"build_wheel: the output must be named {want} (got {a.out})", file=sys.stderr)
        return 2
    dist = f"pipec-{a.version}.dist-info"
    data = f"pipec-{a.version}.data/scripts"
    files = []  # (name in the wheel, bytes, executable)
    for src in sorted(a.sources):
        files.append((f"pipec/{os.path.basename(src)}", open(src, "rb").read(), False))
    files.append((f"pipec/{os.path.basename(a.ext)}", open(a.ext, "rb").read(), True))
    for script in a.script:
        files.append((f"{data}/{os.path.basename(script)}", open(script, "rb").read(), True))
    files.append((f"{dist}/METADATA", (
        "Metadata-Version: 2.1\n"
        f"Name: pipec\nVersion: {a.version}\n"
        "Summary: Pipeline schedule compiler and runtime for LLM training: compile, verify, "
        "simulate and run pipeline-parallel schedules\n"
        "Requires-Python: >=3.11,<3.12\n"
        "Provides-Extra: torch\n"
        "Requires-Dist: torch; extra == \"torch\"\n").encode(), False))
    files.append((f"{dist}/WHEEL", (
        "Wheel-Version: 1.0\nGenerator: pipec build_wheel.py\nRoot-Is-Purelib: false\n"
        f"Tag: {tag}\n").encode(), False))
    files.append((f"{dist}/top_level.txt", b"pipec\n", False))
    record = "".join(f"{name},{digest(body)},{len(body)}\n" for name, body, _ in files)
    record += f"{dist}/RECORD,,\n"
    files.append((f"{dist}/RECORD", record.encode(), False))
    tmp = a.out + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name, body, executable in files:
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))  # reproducible
            mode = 0o755 if executable else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, body)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
