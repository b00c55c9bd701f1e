"""Plain (non-river) GGUFs from a base or river GGUF: the baselines River is always shown beside.

- `plain(src, dst, "q4_0")`: every 2-D weight quantized by ggml to one type, the head (output.weight, or
  the tied token_embd) to q6_k as llama-quantize does (q8_0 where rows are not a multiple of 256): `river
  convert --to`. The tables' plain files are llama-quantize's own recipes (measure/files.py).
- `plain(src, dst, "backbone")`: a river GGUF's backbone alone, as stock llama.cpp can load it.
- `plain(src, dst, "river")`: the model made of the river weights (each layer's seven matrices swapped
  for its river twin, the head for the river head if there is one), which all-river must equal.
"""
from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as T, GGUFValueType as V

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.progress import Progress

from . import quant
from .build import to_f32
from .writer import Tensor, arch_of, check_dst, kv_of, write
from .reader import ggml_shape, n_dims, open_gguf

# bf16 is a type of the tiny test models (tests/test_invariance.py), not a conversion target
CONVERSIONS = ("backbone", "river", *(t for t in quant.TYPES if t != "bf16"))


def _requant(t, qt: T) -> Tensor:
    shape = ggml_shape(t)
    qt = quant.type_for_row(qt, shape[0])
    if t.tensor_type == qt:
        return Tensor(t.name, shape, qt, lambda: t.data)
    return Tensor(t.name, shape, qt, lambda: quant.quantize(to_f32(t.data, t.tensor_type, t.name), qt))


def plain(src: str | Path, dst: str | Path, mode: str, progress: Progress | None = None,
          marks: dict[str, str] | None = None) -> Path:
    src, dst = Path(src), Path(dst)
    mode = mode.lower()
    if mode not in CONVERSIONS:
        raise RiverError(f"unknown conversion {mode!r}: use one of {', '.join(CONVERSIONS)}")
    check_dst(src, dst, same_ok=False)
    r = open_gguf(src)
    arch, _ = arch_of(r, src)
    by_name = {t.name: t for t in r.tensors}
    is_river = any(n.startswith("river.") for n in by_name)
    if mode in ("backbone", "river") and not is_river:
        raise RiverError(f"{src}: no river tensors, so no {mode} to extract; build one with `river build`")
    head = "output.weight" if "output.weight" in by_name else "token_embd.weight"
    out = []
    for t in r.tensors:
        if t.name.startswith("river."):
            continue
        if mode == "backbone":
            out.append(Tensor(t.name, ggml_shape(t), t.tensor_type, lambda t=t: t.data))
        elif mode == "river":
            parts = t.name.split(".")
            twin = by_name.get(F.river_tensor(int(parts[1]), parts[2])) if parts[0] == "blk" and parts[3:] == ["weight"] else None
            if t.name == "output.weight":
                twin = by_name.get(F.RIVER_HEAD)
            s = twin or t  # the river twin's data under the backbone's name
            out.append(Tensor(t.name, ggml_shape(t), s.tensor_type, lambda s=s: s.data))
        elif n_dims(ggml_shape(t)) < 2:
            out.append(Tensor(t.name, ggml_shape(t), t.tensor_type, lambda t=t: t.data))
        else:
            qt = quant.ggml_type(mode)
            if t.name == head and mode not in ("f16", "q8_0"):
                qt = T.Q6_K
            out.append(_requant(t, qt))
    if mode == "river" and head == "token_embd.weight" and (rh := by_name.get(F.RIVER_HEAD)) is not None:
        # tied embeddings: the river head becomes an untied output.weight (llama.cpp loads one if present)
        out.append(Tensor("output.weight", ggml_shape(rh), rh.tensor_type, lambda: rh.data))
    kv = [x for x in kv_of(r, skip={"general.architecture", "general.file_type"}) if not x[0].startswith("river.")]
    if mode in quant.FILE_TYPES:
        kv.insert(0, ("general.file_type", int(quant.FILE_TYPES[mode]), V.UINT32, None))
    kv += [(k, v, V.STRING, None) for k, v in (marks or {}).items()]   # e.g. bench's mark on the files it derives
    write(dst, arch, kv, out, progress)
    return dst
