"""What llama.cpp's CPU backend does to activations, so the reference can match it to ~1e-5.

A ggml matmul converts its f32 activations to the weight type's `vec_dot_type` before the dot product:
F16 weights see f16 activations, Q4_0/Q5_0/Q8_0 see Q8_0 blocks, Q4_1/Q5_1 see Q8_1 (same values),
k-quants see Q8_K. Rounding the activations the same way leaves only summation-order noise.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from river_edge.gguf_tools.reader import open_gguf

_Q8_0 = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}
_Q8_K = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}


def round_f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    # x86 quantize_row_q8_0: d = amax/127 stored as f16, q = round-half-even(x * 127/amax).
    b = x.reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = round_f16(amax / 127)
    q = torch.round(b * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q * d).reshape(x.shape)


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    # quantize_row_q8_K_ref: scale by the signed extreme, -127/max, round half away from zero, f32 scale.
    b = x.reshape(*x.shape[:-1], -1, 256)
    idx = b.abs().argmax(-1, keepdim=True)
    mx = torch.gather(b, -1, idx)
    iscale = torch.where(mx != 0, -127 / mx, torch.zeros_like(mx))
    v = b * iscale
    q = torch.clamp(torch.sign(v) * torch.floor(v.abs() + 0.5), max=127)
    d = torch.where(iscale != 0, 1 / iscale, torch.zeros_like(iscale))
    return (q * d).reshape(x.shape)


def activation_rounding(wtype: T):
    """The rounding ggml applies to activations multiplied by a weight of type wtype."""
    if wtype == T.F16:
        return round_f16
    if wtype in _Q8_0:
        return round_q8_0
    if wtype in _Q8_K:
        return round_q8_k
    return lambda x: x  # F32 (and BF16 on CPUs without it: close enough)


def unrounded_weights(llm) -> list[str]:
    """Weights of a loaded llama_cpp.Llama that ggml multiplies with f32 activations as they are: F16 weights
    placed in the AMX buffer type (its F16 kernels widen the weight to f32 instead of rounding activations)."""
    from river_edge.runtime.capi import tensor_buft

    return [t.name for t in open_gguf(llm.model_path).tensors
            if t.tensor_type == T.F16 and tensor_buft(llm, t.name) == "AMX"]
