"""The benchmark JSON as the results pages read it: the models' names, one step's JSON, and the host line that
keeps every table to one host."""
from __future__ import annotations

import json
from pathlib import Path

SMOL, QWEN, QWEN15 = "smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
PLAIN = "shipped,q8_0,q4_k_m,q4_0"   # what a user would run instead


def load(out: Path, name: str) -> dict | None:
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def dash(v, f="{:.2f}"):
    return "-" if v is None else f.format(v)


def host_line(m: dict) -> str:
    """The host line every speed table carries: figures from other hosts never share a table."""
    cpu = (m.get("host") or {}).get("cpu") or {}
    isa = [x for x in cpu.get("isa", []) if x in ("avx2", "avx512f", "amx_tile", "asimd", "sve")]
    bt = sorted({b for f in (m.get("buffer_types") or {}).values() for kinds in f.values() for b in kinds})
    load = (m.get("load_before") or {}).get("loadavg_1_5_15")
    return (f"host {cpu.get('model', 'not recorded')}" + (f" ({', '.join(isa)})" if isa else "") +
            f", {m.get('threads')} threads" + (f", load {load[0]}" if load else "") +
            (f", weights in {'/'.join(bt)} buffers" if bt else ""))


def where(m: dict) -> str:
    """A section's host: its host line, or that its JSON predates host records (so it is compared with nothing
    measured elsewhere)."""
    if ((m.get("host") or {}).get("cpu") or {}).get("model"):
        return host_line(m)
    return "host not recorded (a run from before JSONs named their host: compare it only within this section)"
