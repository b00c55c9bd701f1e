"""The benchmark JSON of `river bench`: written with its figure (check_out, write). Which folder of the repository's
results tree a run goes to, and how the results pages read it, is bench/recorded.py's."""
from __future__ import annotations

import json
import os
from pathlib import Path

from river_edge.format import RiverError
from river_edge.gguf_tools.writer import replacing_together


def check_out(out_dir: str | Path) -> Path:
    """The folder the results go to, made and checked before a measurement (not after minutes of it): a folder
    this process can write."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RiverError(f"{out_dir}: cannot make the output folder ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise RiverError(f"{out_dir}: the output folder is not writable")
    return out_dir


def write_record(res: dict, out_dir: str | Path, stem: str, plot) -> tuple[Path, Path]:
    """res as <stem>.json and plot(res) as <stem>.png in out_dir (plot: a figure of measure/plots.py), the two
    together or neither."""
    out_dir = check_out(out_dir)
    j, png = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    with replacing_together([j, png]) as (tj, tpng):
        tj.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        plot(res, tpng)
    return j, png
