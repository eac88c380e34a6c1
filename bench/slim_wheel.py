"""Rewrite a wheel without the subfolders of one folder in it, so it fits the device tool's 64 MiB carry.

flashinfer-python 0.7.4's wheel is 97 MiB: 41 MiB of it is CUDA sources in subfolders of `flashinfer/data/csrc/`
(MoE, sampling, all-reduce, ... kernels' own folders), which the modules this project JIT-builds (the fa3/fa2 batch
prefill: `batch_prefill*.cu`, `*.jinja`, `*.inc` at the top of `csrc/`, plus `data/include`, `data/cutlass`,
`data/cccl`) never read. The Python code and every other file stay as they are, byte for byte; RECORD loses the
dropped files' lines (pip installs the rest with their hashes checked). The wheel keeps its name.

    python -m bench.slim_wheel IN.whl OUT_DIR --drop-subfolders flashinfer/data/csrc
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path


def dropped(name: str, folder: str) -> bool:
    """A file in a subfolder of `folder` (not one directly in it)."""
    prefix = folder.rstrip("/") + "/"
    return name.startswith(prefix) and "/" in name[len(prefix) :]


def slim(wheel: Path, out_dir: Path, folder: str) -> tuple[Path, int, int]:
    """→ (the slim wheel, files dropped, files kept)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    if out.resolve() == wheel.resolve():
        raise SystemExit(f"{out}: the output would overwrite the input")
    drop = keep = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if dropped(info.filename, folder):
                drop += 1
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not dropped(line.split(",", 1)[0], folder)).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            keep += 1
    return out, drop, keep


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--drop-subfolders", required=True, help="a folder in the wheel whose subfolders go")
    args = ap.parse_args(argv)
    out, drop, keep = slim(args.wheel, args.out_dir, args.drop_subfolders)
    mib = 1 << 20
    print(f"{out}: {args.wheel.stat().st_size / mib:.1f} → {out.stat().st_size / mib:.1f} MiB "
          f"({drop} files dropped, {keep} kept)")  # fmt: skip


if __name__ == "__main__":
    main()
