"""Pack a GPU-machine call's outputs so that at most 8 files come back (the device tool returns
at most 8 files of <= 16 MB each; more are left out, and the logs went first).

    python scripts/gpu/pack_outputs.py OUT [--jit-dir /tmp/jit] [--e2e-logs /tmp/e2e_logs]

Side effects under OUT: every ``*.log`` except ``run.log`` (and the e2e server logs) moves into
``logs.tar.xz``; the JIT caches under --jit-dir become ``jit.tar.xz`` (one archive, one folder
per cache; restored by scripts/gpu/run.sh from ``.jit/*.tar.xz``) or, when that exceeds the size
limit, one ``jit-<cache>.tar.xz`` per cache that fits. Prints what it wrote and what it left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
from pathlib import Path

MAX_BYTES = 15_500_000
"""Largest archive kept (the device tool's limit is 16 MB per returned file)."""


def _tar(path: Path, members: list[tuple[Path, str]]) -> int:
    with tarfile.open(path, "w:xz", preset=6) as t:
        for src, arcname in members:
            t.add(str(src), arcname=arcname)
    return path.stat().st_size


def pack_logs(out: Path, e2e_logs: Path | None) -> list[str]:
    logs = sorted(p for p in out.glob("*.log") if p.name != "run.log")
    members = [(p, p.name) for p in logs]
    if e2e_logs is not None and e2e_logs.is_dir():
        members.append((e2e_logs, e2e_logs.name))
    if not members:
        return []
    size = _tar(out / "logs.tar.xz", members)
    for p in logs:
        p.unlink()
    return [f"logs.tar.xz: {size} bytes ({len(members)} entries)"]


def pack_jit(out: Path, jit_dir: Path, max_bytes: int = MAX_BYTES) -> list[str]:
    if not jit_dir.is_dir():
        return []
    caches = sorted(d for d in jit_dir.iterdir() if d.is_dir())
    if not caches:
        return []
    whole = out / "jit.tar.xz"
    size = _tar(whole, [(d, d.name) for d in caches])
    if size <= max_bytes:
        return [f"jit.tar.xz: {size} bytes ({', '.join(d.name for d in caches)})"]
    whole.unlink()
    notes = []
    for d in caches:
        path = out / f"jit-{d.name}.tar.xz"
        size = _tar(path, [(d, d.name)])
        if size > max_bytes:
            path.unlink()
            notes.append(f"jit cache {d.name}: {size} bytes, too large, left out")
        else:
            notes.append(f"jit-{d.name}.tar.xz: {size} bytes")
    return notes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--jit-dir", type=Path, default=Path("/tmp/jit"))
    parser.add_argument("--e2e-logs", type=Path, default=Path("/tmp/e2e_logs"))
    args = parser.parse_args()
    for line in pack_logs(args.out, args.e2e_logs) + pack_jit(args.out, args.jit_dir):
        print(line)
    files = sorted(p.name for p in args.out.iterdir() if p.is_file())
    print(f"{len(files)} files to return: {', '.join(files)}")
    if len(files) > 8:
        print("warning: more than 8 files; the device tool will leave some out", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
