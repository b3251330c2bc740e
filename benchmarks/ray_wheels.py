"""Ray Serve's wheels, trimmed to what exlpy on Ray Serve runs, for a GPU machine that cannot download them
(benchmarks/ray_parts.sh drives this; see its header for the device calls).

    python benchmarks/ray_wheels.py trim RAY.whl OUT_DIR     # a copy of the ray wheel without DROP, RECORD fixed
    python benchmarks/ray_wheels.py split SRC_DIR DEST_DIR --first-mb 48
        # SRC_DIR's wheels into DEST_DIR/a and DEST_DIR/b: ray and the largest that fit in `a`, the rest in `b`

Why each part of ray 2.60's wheel can go (it is 79 MB; without these ~39 MB):
- jars/ (32 MB): Java workers' classes; exlpy's replicas are Python workers.
- rllib, data, train, tune, llm: libraries on Ray that Serve does not import (Serve's own `serve.llm` imports
  ray.llm, but only when a user imports `ray.serve.llm`, which exlpy does not).
- dashboard/client/build (2.5 MB): the dashboard web page's JavaScript; exlpy's runs start Ray with
  include_dashboard=False, and the per-node dashboard agent (metrics, logs) keeps its Python modules.
The wheel stays installable with pip (`--no-index --no-deps --target`): RECORD lists exactly the files kept, with
their original hashes (pip reads RECORD when installing; a removed file listed there would be an inconsistency).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import zipfile
from pathlib import Path

DROP = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/train/", "ray/tune/", "ray/llm/",
        "ray/dashboard/client/build/")


def trim(src: Path, out_dir: Path, drop: tuple[str, ...] = DROP) -> Path:
    """Write `src` without the members under `drop` to out_dir (same file name); returns the new wheel."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    kept = dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if info.filename.startswith(drop):
                dropped += info.file_size
                continue
            if info.filename == record_name:
                continue
            zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            kept += 1
        lines = zin.read(record_name).decode().splitlines()
        record = [ln for ln in lines if ln and not ln.split(",", 1)[0].startswith(drop)]
        zout.writestr(zipfile.ZipInfo(record_name, date_time=(2026, 1, 1, 0, 0, 0)), "\n".join(record) + "\n",
                      compress_type=zipfile.ZIP_DEFLATED)
    print(f"{src.name}: kept {kept} files, dropped {dropped / 1e6:.1f} MB uncompressed; "
          f"{src.stat().st_size / 1e6:.1f} -> {dst.stat().st_size / 1e6:.1f} MB", flush=True)
    return dst


def split(src: Path, dest: Path, first_mb: float) -> None:
    """Ray's wheel first into `a`, then the other wheels by size, largest first, while `a` stays within
    first_mb; the rest into `b`. Each part installs on its own (pip --no-deps), so each device call installs
    what it carried."""
    wheels = sorted(src.glob("*.whl"), key=lambda p: (not p.name.startswith("ray-"), -p.stat().st_size))
    for part in ("a", "b"):
        shutil.rmtree(dest / part, ignore_errors=True)
        (dest / part).mkdir(parents=True)
    used = 0
    for w in wheels:
        size = w.stat().st_size
        part = "a" if w.name.startswith("ray-") or used + size <= first_mb * 1e6 else "b"
        used += size if part == "a" else 0
        shutil.copy2(w, dest / part / w.name)
    for part in ("a", "b"):
        files = sorted((dest / part).iterdir())
        total = sum(f.stat().st_size for f in files)
        print(f"{dest / part}: {len(files)} wheels, {total / 1e6:.1f} MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trim")
    t.add_argument("wheel", type=Path)
    t.add_argument("out_dir", type=Path)
    s = sub.add_parser("split")
    s.add_argument("src", type=Path)
    s.add_argument("dest", type=Path)
    s.add_argument("--first-mb", type=float, default=48.0)
    args = ap.parse_args()
    if args.cmd == "trim":
        if not args.wheel.is_file():
            sys.exit(f"ray_wheels: no wheel at {args.wheel}")
        trim(args.wheel, args.out_dir)
    else:
        if not any(args.src.glob("ray-*.whl")):
            sys.exit(f"ray_wheels: no ray wheel in {args.src}")
        os.makedirs(args.dest, exist_ok=True)
        split(args.src, args.dest, args.first_mb)


if __name__ == "__main__":
    main()
