"""Weights and hyper-parameters of a (river) GGUF, dequantized by gguf-py."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from river_edge import format as F
from river_edge.format import RiverError


@dataclass
class Args:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ff: int
    n_vocab: int
    rope_base: float
    eps: float
    thresholds: list[float] = field(default_factory=list)
    min_exit_layer: int = F.DEFAULT_MIN_EXIT_LAYER
    # optional hyper-parameters, with llama.cpp's defaults where the GGUF has no key
    rope_freqs: torch.Tensor | None = None  # Llama 3's per-dimension RoPE frequency divisors (rope_freqs.weight)
    n_swa: int = 0                          # sliding window in tokens (0: none)
    swa_pattern: int | list[bool] | None = None  # which layers slide: every layer but each n-th, or one flag each
    rope_base_swa: float = 10000.0
    softcap: float = 0.0                    # final logit soft-capping
    temp_scale: float = 0.0                 # Llama 4 attention temperature (Ministral 3)
    n_ctx_orig: int = 0


@dataclass
class Weight:
    """A dequantized matrix (torch layout [out, in]) and the ggml type it is stored in."""
    w: torch.Tensor
    type: GGMLQuantizationType


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def read_gguf(path: str | Path) -> tuple[Args, dict[str, Weight]]:
    path = Path(path)
    if not path.is_file():
        raise RiverError(f"{path}: no such file")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError/struct errors on foreign or truncated files
        raise RiverError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in F.ARCHITECTURES:
        raise RiverError(f"{path}: unsupported architecture '{arch}': river-edge supports {', '.join(F.ARCHITECTURES)}")
    k = lambda name, default=None: _field(reader, f"{arch}.{name}", default)
    n_embd, n_head = int(k("embedding_length")), int(k("attention.head_count"))
    head_dim = int(k("attention.key_length", n_embd // n_head))
    tensors = {}
    for t in reader.tensors:
        data = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
        tensors[t.name] = Weight(torch.from_numpy(np.array(data, copy=not data.flags.writeable)), t.tensor_type)
    n_layer = int(k("block_count"))
    args = Args(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=int(k("attention.head_count_kv", n_head)), head_dim=head_dim,
        n_rot=int(k("rope.dimension_count", head_dim)), n_ff=int(k("feed_forward_length")),
        n_vocab=tensors["token_embd.weight"].w.shape[0], rope_base=float(k("rope.freq_base", 10000.0)),
        eps=float(k("attention.layer_norm_rms_epsilon")),
        thresholds=[float(x) for x in _field(reader, F.KEY_THRESHOLDS, [float("inf")] * n_layer)],
        min_exit_layer=int(_field(reader, F.KEY_MIN_EXIT, F.DEFAULT_MIN_EXIT_LAYER)),
        rope_freqs=tensors["rope_freqs.weight"].w if "rope_freqs.weight" in tensors else None,
        n_swa=int(k("attention.sliding_window", 0)), swa_pattern=k("attention.sliding_window_pattern"),
        rope_base_swa=float(k("rope.freq_base_swa", 10000.0)), softcap=float(k("final_logit_softcapping", 0.0)),
        temp_scale=float(k("attention.temperature_scale", 0.0)),
        n_ctx_orig=int(k("rope.scaling.original_context_length", k("context_length", 0))),
    )
    return args, tensors
