"""Compile the switch program and record what it was compiled from.

``python -m aggnet.p4.compile`` runs p4c (BMv2, v1model) on p4/aggnet/main.p4
and writes the committed artifacts: ``build/aggnet.json`` (BMv2),
``build/aggnet.p4info.txtpb`` (P4Info) and ``build/SOURCES`` (a digest of
every P4 source and the compiler's version). Without a compiler, a test
still checks that the digest matches the sources, so sources never change
without their artifacts.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from aggnet.p4.tools import find_tool

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "aggnet"
BUILD = HERE / "build"
BMV2_JSON = BUILD / "aggnet.json"
P4INFO = BUILD / "aggnet.p4info.txtpb"
DIGEST = BUILD / "SOURCES"


def find_p4c() -> str | None:
    return find_tool("p4c")


def sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(SOURCES.glob("*.p4")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def recorded_digest() -> str | None:
    if not DIGEST.exists():
        return None
    for line in DIGEST.read_text().splitlines():
        if line.startswith("sha256 "):
            return line.split()[1]
    return None


def compile_to(out: Path, p4c: str) -> tuple[Path, Path]:
    """Compile into ``out``; paths inside the JSON are relative to p4/, so
    the output does not depend on where the repository lies."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [p4c, "--target", "bmv2", "--arch", "v1model", "--Wdisable", "unused", "-o", str(out),
           "--p4runtime-files", str(out / "aggnet.p4info.txtpb"), "aggnet/main.p4"]
    r = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"p4c failed:\n{r.stdout}{r.stderr}")
    json_path = out / "main.json"
    # p4c records where it wrote its preprocessed input; keep the artifact
    # independent of the build directory
    text = re.sub(r'"program" : "[^"]*"', '"program" : "aggnet/main.p4"', json_path.read_text())
    json_path.write_text(text)
    return json_path, out / "aggnet.p4info.txtpb"


def p4c_version(p4c: str) -> str:
    return subprocess.run([p4c, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--p4c", default=None, help="the compiler (default: p4c on PATH or in /opt/p4/bin)")
    args = p.parse_args(argv)
    p4c = args.p4c or find_p4c()
    if p4c is None:
        print("p4c is not installed: the committed artifacts in p4/build stay as they are", file=sys.stderr)
        return 1
    from aggnet.p4 import generate

    if generate.main(["--check"]) != 0:
        print("regenerate first: python -m aggnet.p4.generate", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        json_path, p4info = compile_to(Path(tmp), p4c)
        if _unchanged(json_path, p4info):
            # another build of the same compiler may name itself otherwise:
            # a clean tree stays clean when nothing it builds changed
            print(f"{BUILD} is up to date: the same sources, and the artifacts byte for byte")
            return 0
        BUILD.mkdir(exist_ok=True)
        shutil.copyfile(json_path, BMV2_JSON)
        shutil.copyfile(p4info, P4INFO)
    DIGEST.write_text(f"sha256 {sources_digest()}\ncompiler {p4c_version(p4c)}\n")
    print(f"wrote {BMV2_JSON}, {P4INFO} and {DIGEST}")
    return 0


def _unchanged(json_path: Path, p4info: Path) -> bool:
    """Whether the committed artifacts equal these and record these sources."""
    try:
        recorded = DIGEST.read_text().split()[1]
        return (recorded == sources_digest() and json_path.read_bytes() == BMV2_JSON.read_bytes()
                and p4info.read_bytes() == P4INFO.read_bytes())
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    raise SystemExit(main())
