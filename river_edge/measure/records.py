"""The benchmark JSON: written with its figure (check_out, write), into this machine's folder of a results tree
(host_folder: bench/'s studies write there). How the results pages read it is bench/recorded.py's."""
from __future__ import annotations

import json
import os
from pathlib import Path

from river_edge.format import RiverError
from river_edge.gguf_tools.writer import replacing_together


def machine(h: dict | None) -> tuple | None:
    """What makes two host records one machine for speed: CPU model, ISA and core count (None: not recorded)."""
    cpu = (h or {}).get("cpu") or {}
    return (cpu["model"], tuple(cpu.get("isa", ())), cpu.get("cpus")) if cpu.get("model") else None


def recorded_machine(p: Path) -> tuple | None:
    """machine() of a JSON file's host record; None for a file without one (or not a JSON object)."""
    try:
        d = json.loads(p.read_text())
        return machine(d.get("host")) if isinstance(d, dict) and isinstance(d.get("host"), dict) else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def other_hosts(out: Path) -> list[Path]:
    """Folders of runs from hosts other than the one `out` (bench/results/) itself was measured on,
    bench/results/hosts/NAME/ (host_folder): their own tables, never mixed into these."""
    return sorted(p for p in (out / "hosts").glob("*") if p.is_dir())


def host_folder(out: Path, here: dict) -> Path:
    """Where this machine's speed JSONs go (`here`: host.host()): `out` when its speed JSONs were measured on this
    machine or it has none; else the folder of out/hosts/ holding this machine's; else a new one named after the CPU
    and ggml's variant (with the core count, then a number, where that name is another machine's). So a run on
    another machine never skips a step because a different host did it, and never writes into that host's tables."""
    me = machine(here)
    for folder in (out, *other_hosts(out)):
        seen = {recorded_machine(p) for p in folder.glob("modes_*.json")} - {None}
        if me in seen or (folder == out and not seen):
            return folder
    cpu = here["cpu"]["model"] + " " + ((here.get("runtime") or {}).get("cpu_variant") or "")
    name = "-".join("".join(c if c.isalnum() else " " for c in cpu.lower()).split()) or "host"
    for n in (name, f"{name}-{here['cpu'].get('cpus')}c", *(f"{name}-{i}" for i in range(2, 100))):
        if not (out / "hosts" / n).exists():
            return out / "hosts" / n
    raise RiverError(f"{out / 'hosts'}: no free folder name for this machine's results")


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


def write(res: dict, out_dir: str | Path, stem: str, plot) -> tuple[Path, Path]:
    """res as <stem>.json and plot(res) as <stem>.png in out_dir (plot: a figure of measure/plots.py), the two
    together or neither."""
    out_dir = check_out(out_dir)
    j, png = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    with replacing_together([j, png]) as (tj, tpng):
        tj.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        plot(res, tpng)
    return j, png
