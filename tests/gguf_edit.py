"""Test helper: copy a GGUF with keys or tensors changed, dropped or added (to make broken files)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from river_edge import format as F
from river_edge.gguf_tools.build import _kv, _Tensor, _write
from river_edge.gguf_tools.reader import ggml_shape, open_gguf

DROP = object()


def rewrite(src: Path, dst: Path, keys: dict | None = None, tensors: dict | None = None, arch: str | None = None) -> Path:
    """keys: {name: DROP | (value, GGUFValueType[, sub_type])}; tensors: {name: DROP | (ggml_shape, type, data)}."""
    keys, tensors = dict(keys or {}), dict(tensors or {})
    r = open_gguf(src)
    arch = arch or r.fields["general.architecture"].contents()
    kv = []
    for k, v, t, s in _kv(r, skip={"general.architecture"}):
        new = keys.pop(k, None)
        if new is DROP:
            continue
        kv.append((k, *new, *((None,) if new and len(new) == 2 else ())) if new else (k, v, t, s))
    kv += [(k, *v, *((None,) if len(v) == 2 else ())) for k, v in keys.items() if v is not DROP]
    out = []
    for t in r.tensors:
        new = tensors.pop(t.name, None)
        if new is DROP:
            continue
        out.append(_Tensor(t.name, *new[:2], lambda d=new[2]: d) if new else
                   _Tensor(t.name, ggml_shape(t), t.tensor_type, lambda t=t: t.data))
    out += [_Tensor(n, *v[:2], lambda d=v[2]: d) for n, v in tensors.items() if v is not DROP]
    _write(Path(dst), arch, kv, out, None)
    return Path(dst)


def f32_tensor(shape: tuple[int, ...], value: float = 0.0):
    """(ggml shape, type, data) of an F32 tensor for rewrite()."""
    return shape, GGMLQuantizationType.F32, np.full(tuple(reversed(shape)), value, np.float32)


def swapped(src: Path, dst: Path, layers, head: bool = False) -> Path:
    """A plain GGUF whose given layers (and with `head` the LM head: output.weight, added when tied) carry
    their river weights in the backbone's place."""
    r = open_gguf(src)
    by = {t.name: t for t in r.tensors}
    new = {}
    if head:
        t = by[F.RIVER_HEAD]
        new["output.weight"] = (ggml_shape(t), t.tensor_type, t.data)
    for i in layers:
        for w in F.LAYER_WEIGHTS:
            t = by[F.river_tensor(i, w)]
            new[F.backbone_tensor(i, w)] = (ggml_shape(t), t.tensor_type, t.data)
    return rewrite(src, dst, tensors=new)


__all__ = ["DROP", "GGUFValueType", "f32_tensor", "rewrite", "swapped"]
