"""The committed records as the results pages read them (bench/report.py, headline.py, steps.py): the models'
names, one step's JSON, the host line that keeps every table to one host, and the folder of this machine's runs
(host_folder: every study writes there)."""
from __future__ import annotations

import json
from pathlib import Path

from river_edge.format import RiverError

SMOL, QWEN, QWEN15, GEMMA = "smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"
PLAIN_CONFIGS = "shipped,q8_0,q4_k_m,q4_0"   # what a user would run instead



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

def load_record(out: Path, name: str) -> dict | None:
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def load_modes(out: Path, key: str) -> dict | None:
    """modes_<key>.json, its same-text counts taken from text_<key>.json where that pass was made: every
    configuration once over 16 or more distinct prompts (bench/results.py's text steps), where the timed rounds
    repeat 4 prompts. m["same_text"] then says where and how those counts were made."""
    m = load_record(out, f"modes_{key}")
    t = load_record(out, f"text_{key}") if m else None
    if not t:
        return m
    missing = set(m["configs"]) - set(t["configs"])
    if missing:
        raise RiverError(f"{out / f'text_{key}.json'}: no same-text count for {', '.join(sorted(missing))}")
    for c, d in m["configs"].items():
        d["identical_runs_timed"], d["runs_timed"] = d["identical_runs"], d["runs"]
        d["identical_runs"], d["runs"] = t["configs"][c]["identical_runs"], t["configs"][c]["runs"]
    m["same_text"] = {"prompts": len(t["prompts"]), "tokens": t["tokens"], "host": host_line(t).split(", load")[0],
                      "cpu_variant": ((t.get("host") or {}).get("runtime") or {}).get("cpu_variant"),
                      "build": ((t.get("host") or {}).get("runtime") or {}).get("build"),
                      "as_host": t.get("as_host")}
    return m


def same_text_note(m: dict) -> str:
    """One line under a modes table: where its same-text counts come from."""
    s = m.get("same_text")
    if not s:
        return (f"*Runs identical to backbone*: the timed runs ({len(m['prompts'])} prompts x {m['rounds']} rounds).")
    where = f"{s['host']}, ggml's {s['cpu_variant']} variant"
    if s.get("as_host"):
        where += (f", the variant {s['as_host']} loads, at its thread count: the same code on the same data, so "
                  "the same bits")
    return (f"*Runs identical to backbone*: every configuration once over {s['prompts']} distinct chat prompts, "
            f"{s['tokens']} greedy tokens each (the timed runs' prompts among them), untimed, on {where}.")


def dash(v, f="{:.2f}"):
    return "-" if v is None else f.format(v)


def cpu_words(m: dict) -> str:
    """A record's CPU in a few words: its model and the ISA flags that decide ggml's kernels."""
    cpu = (m.get("host") or {}).get("cpu") or {}
    isa = [x for x in cpu.get("isa", []) if x in ("avx2", "avx512f", "amx_tile", "asimd", "sve")]
    return cpu.get("model", "not recorded") + (f" ({', '.join(isa)})" if isa else "")


def host_line(m: dict) -> str:
    """The host line every speed table carries: figures from other hosts never share a table."""
    bt = sorted({b for f in (m.get("buffer_types") or {}).values() for kinds in f.values() for b in kinds})
    h = m.get("host") or {}
    load = m.get("load_before") or (m.get("machine") or {}).get("load_before") or {}
    load = load.get("loadavg_1_5_15") if isinstance(load, dict) else load   # spec_compare: os.getloadavg() itself
    load = load or h.get("loadavg_1_5_15")
    return (f"host {cpu_words(m)}" +
            f", {m.get('threads') or h.get('threads')} threads" + (f", load {load[0]:.2f}" if load else "") +
            (f", weights in {'/'.join(bt)} buffers" if bt else ""))


def where(m: dict) -> str:
    """A section's host: its host line, or that its JSON predates host records (so it is compared with nothing
    measured elsewhere)."""
    if ((m.get("host") or {}).get("cpu") or {}).get("model"):
        return host_line(m)
    return "host not recorded (a run from before JSONs named their host: compare it only within this section)"
