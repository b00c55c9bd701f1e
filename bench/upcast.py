"""How close the F16 backbone is to the shipped file: `river build` upcasts a quantized source by dequantizing
it and rounding to F16 (gguf_tools/build.py), which moves part of the weights. Counted over every matrix (measure_upcast), and
the results page's paragraph on it (upcast_section)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from river_edge.gguf_tools.build import to_f32
from river_edge.gguf_tools.reader import ggml_shape, n_dims, open_gguf

from bench.recorded import QWEN, QWEN15, SMOL, load_record

F16_TINY = float(np.finfo(np.float16).tiny)   # below it F16 is subnormal: fewer bits than 2^-11 relative


def measure_upcast(src: str | Path, progress=None) -> dict:
    """Per weight type of `src`: weights, how many the F16 rounding moves, the largest relative move among
    weights in F16's normal range, and how many lie below it or round to zero."""
    types: dict[str, dict] = {}
    tensors = [t for t in open_gguf(src).tensors if n_dims(ggml_shape(t)) >= 2]
    for i, t in enumerate(tensors):
        x = to_f32(t.data, t.tensor_type, t.name).ravel()
        y = x.astype(np.float16).astype(np.float32)
        nz = x != 0
        normal = np.abs(x) >= F16_TINY
        rel = np.abs(y[normal] - x[normal]) / np.abs(x[normal])
        d = types.setdefault(t.tensor_type.name, dict(weights=0, moved=0, max_rel=0.0, below_normal=0, to_zero=0))
        d["weights"] += x.size
        d["moved"] += int((x != y).sum())
        d["max_rel"] = max(d["max_rel"], float(rel.max()) if rel.size else 0.0)
        d["below_normal"] += int((nz & ~normal).sum())
        d["to_zero"] += int((nz & (y == 0)).sum())
        if progress:
            progress("matrices", i + 1, len(tensors))
    n = sum(d["weights"] for d in types.values())
    return {"source": Path(src).name, "types": types, "weights": n,
            "moved_share": sum(d["moved"] for d in types.values()) / max(n, 1),
            "max_rel": max((d["max_rel"] for d in types.values()), default=0.0), "f16_unit_roundoff": 2.0 ** -11}


def upcast_section(out: Path) -> list[str]:
    """The results page's paragraph on the upcast, from the upcast_*.json in `out`."""
    got = [(m, u) for m in (SMOL, QWEN, QWEN15) if (u := load_record(out, f"upcast_{m}"))]
    if not got:
        return []
    below = sum(d["below_normal"] for _, u in got for d in u["types"].values())
    zero = sum(d["to_zero"] for _, u in got for d in u["types"].values())
    return ["**The backbone against the shipped file** (`upcast_*.json`, bench/upcast.py, every "
            "matrix): `river build` upcasts a quantized source by rounding its dequantized weights to F16, which moves "
            + "; ".join(f"{u['moved_share']:.0%} of {m}'s weights ({'/'.join(u['types'])})" for m, u in got)
            + f", each by at most {max(u['max_rel'] for _, u in got):.3g} of its value (F16's unit roundoff, 2^-11) "
            f"where F16 is normal; {below:,} weights lie below that range and lose more, "
            + ("none rounds to zero" if not zero else f"{zero:,} round to zero") +
            ". So the backbone is a close twin of the shipped file, not a copy: ggml's kernels for the shipped types "
            "also quantize activations to 8 bits where the F16 ones round them to F16, so the shipped file need not "
            "write the backbone's text (*same text* of its rows in the modes tables). `river build --backbone keep` "
            "keeps the shipped tensors exactly.", ""]
