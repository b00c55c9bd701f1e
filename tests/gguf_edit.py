"""Test helpers over gguf_tools.writer.copy: GGUFs with keys or tensors changed, dropped or added (broken files),
and stock GGUFs carrying river weights in the backbone's place."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from river_edge import format as F
from river_edge.gguf_tools.reader import ggml_shape, open_gguf
from river_edge.gguf_tools.writer import DROP, copy


def rewrite(src: Path, dst: Path, keys: dict | None = None, tensors: dict | None = None, arch: str | None = None) -> Path:
    """keys: {name: DROP | (value, GGUFValueType[, sub_type])}; tensors: {name: DROP | (ggml_shape, type, data)}."""
    return copy(src, dst, keys=keys, tensors=tensors, arch=arch)


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
