"""Shrink Ray's wheel to what a one-node slime-spec run uses, so it fits the 64 MiB a lent GPU machine's call carries.

Dropped: the Java jar (Ray's Java workers), the dashboard's web client build (the UI, its source maps), and RLlib,
Tune, Serve and Data (Ray libraries slime-spec never imports). The wheel's RECORD loses the same lines, so pip
installs the result as it would the original.
Usage: python bench/strip_ray_wheel.py ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl OUT_DIR
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

DROPPED_PREFIXES = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/tune/", "ray/serve/", "ray/data/")


def dropped(name: str) -> bool:
    return name.startswith(DROPPED_PREFIXES) or name.endswith(".js.map")


def strip(src: Path, out_dir: Path) -> Path:
    dst = out_dir / src.name
    if dst.resolve() == src.resolve():
        raise SystemExit(f"OUT_DIR must differ from the wheel's folder: {dst} would overwrite the original")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not dropped(line.split(",", 1)[0])).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    out = strip(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB (was {Path(sys.argv[1]).stat().st_size / 2**20:.1f} MiB)")
