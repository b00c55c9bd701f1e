"""How close the F16 backbone is to the shipped file: `river build` upcasts a quantized source by dequantizing
it and rounding to F16 (gguf_tools/build.py), which moves part of the weights. Counted over every matrix."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from river_edge.gguf_tools.build import to_f32
from river_edge.gguf_tools.reader import ggml_shape, n_dims, open_gguf

F16_TINY = float(np.finfo(np.float16).tiny)   # below it F16 is subnormal: fewer bits than 2^-11 relative


def run(src: str | Path, progress=None) -> dict:
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
