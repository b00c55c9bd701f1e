"""Llama decoder layer as llama.cpp computes it (GGUF weights, ggml's 'normal' RoPE on adjacent pairs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ggml_numerics import activation_rounding
from .weights import Args, Weight


class Linear:
    def __init__(self, w: Weight, bias: Weight | None, emulate: bool):
        self.w, self.b = w.w, (bias.w if bias is not None else None)
        self.round = activation_rounding(w.type) if emulate else (lambda x: x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.round(x) @ self.w.T
        return y if self.b is None else y + self.b


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, n_rot: int, base: float, neox: bool,
         factors: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, heads, head_dim], pos: [T]. Rotates the first n_rot dims; `factors` divide each pair's frequency."""
    half = n_rot // 2
    theta = pos[:, None].float() * base ** (-torch.arange(half, dtype=torch.float32) * 2 / n_rot)
    if factors is not None:
        theta = theta / factors
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]
    r, rest = x[..., :n_rot], x[..., n_rot:]
    a, b = (r[..., :half], r[..., half:]) if neox else (r[..., 0::2], r[..., 1::2])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    r = torch.cat([ra, rb], -1) if neox else torch.stack([ra, rb], -1).flatten(-2)
    return torch.cat([r, rest], -1)


class Block:
    """One decoder layer. `mats` holds the seven matrices (backbone or river); norms and biases are shared."""
    neox = False
    window = 0  # attention reaches back this many positions (0: all)

    def __init__(self, args: Args, t: dict[str, Weight], il: int, mats: dict[str, Weight], emulate: bool):
        self.args = args
        p = f"blk.{il}."
        lin = lambda n: Linear(mats[n], t.get(p + n + ".bias"), emulate)
        self.q, self.k, self.v, self.o = (lin(n) for n in ("attn_q", "attn_k", "attn_v", "attn_output"))
        self.gate, self.up, self.down = (lin(n) for n in ("ffn_gate", "ffn_up", "ffn_down"))
        self.attn_norm, self.ffn_norm = t[p + "attn_norm.weight"].w, t[p + "ffn_norm.weight"].w
        self.kq_scale = args.head_dim ** -0.5   # of q.k in attention (ggml_soft_max_ext's scale)

    @staticmethod
    def embed(args: Args, h: torch.Tensor) -> torch.Tensor:
        """The token embeddings as layer 0 reads them."""
        return h

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k per head ([T, heads, head_dim]) before RoPE: as they come, in llama."""
        return q, k

    def rotate(self, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        return tuple(rope(y, pos, a.n_rot, a.rope_base, self.neox, a.rope_freqs) for y in (q, k))

    def project(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k (rotated), v of the tokens h [T, n_embd] at positions pos: [T, heads, head_dim] each."""
        a, T = self.args, h.shape[0]
        x = rms_norm(h, self.attn_norm, a.eps)
        q, k = self.qk(self.q(x).view(T, a.n_head, a.head_dim), self.k(x).view(T, a.n_head_kv, a.head_dim))
        q, k = self.rotate(q, k, pos)
        return q, k, self.v(x).view(T, a.n_head_kv, a.head_dim)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input h and the attention's output attn [T, n_head, head_dim]."""
        a, T = self.args, h.shape[0]
        h = h + self.o(attn.reshape(T, -1))
        x = rms_norm(h, self.ffn_norm, a.eps)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))

    def __call__(self, h: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        """h: [T, n_embd]; attend(q, k, v) -> [T, n_head, head_dim] owns the KV cache."""
        return self.finish(h, attend(*self.project(h, pos)))
