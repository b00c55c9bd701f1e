"""Gemma 3 decoder layer as llama.cpp computes it: embeddings scaled by sqrt(n_embd); RMS norms before and after
attention and the FFN; per-head q/k norms; GELU (tanh); NEOX RoPE with its own base on sliding-window layers; q
scaled before attention (kq_scale 1); sliding-window attention on all layers but every n-th (6 by default)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import llama
from .ggml_numerics import round_f16
from .weights import Args


def is_swa(args: Args, il: int) -> bool:
    """llama.cpp's set_swa_pattern: a pattern n makes every layer but each n-th slide; a list names them."""
    p = args.swa_pattern
    if not args.n_swa:
        return False
    if isinstance(p, list):
        return bool(p[il])
    n = 6 if p is None else int(p)
    return n == 0 or il % n < n - 1


class Block(llama.Block):
    neox = True

    def __init__(self, args, t, il, mats, emulate):
        super().__init__(args, t, il, mats, emulate)
        p = f"blk.{il}."
        self.q_norm, self.k_norm = t[p + "attn_q_norm.weight"].w, t[p + "attn_k_norm.weight"].w
        self.post_attn, self.post_ffn = t[p + "post_attention_norm.weight"].w, t[p + "post_ffw_norm.weight"].w
        self.window = args.n_swa if is_swa(args, il) else 0
        self.base = args.rope_base_swa if self.window else args.rope_base
        # Gemma 3 27B scales by the model width per head, the others by the head size (llama.cpp's gemma3.cpp)
        width = args.n_embd // args.n_head if args.n_layer == 62 else args.head_dim
        self.q_scale, self.kq_scale = 1 / math.sqrt(width), 1.0
        self.emulate = emulate

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """ggml's CPU GELU reads a table indexed by the f16 input (f16 output) for |x| < 10."""
        if not self.emulate:
            return F.gelu(x, approximate="tanh")
        y = round_f16(F.gelu(round_f16(x), approximate="tanh"))
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))

    @staticmethod
    def embed(args: Args, h: torch.Tensor) -> torch.Tensor:
        return h * math.sqrt(args.n_embd)

    def qk(self, q, k):
        eps = self.args.eps
        return llama.rms_norm(q, self.q_norm, eps), llama.rms_norm(k, self.k_norm, eps)

    def rotate(self, q, k, pos):
        a = self.args
        q, k = (llama.rope(y, pos, a.n_rot, self.base, self.neox) for y in (q, k))
        return q * self.q_scale, k

    def finish(self, h, attn):
        a, T, norm = self.args, h.shape[0], llama.rms_norm
        h = h + norm(self.o(attn.reshape(T, -1)), self.post_attn, a.eps)
        x = norm(h, self.ffn_norm, a.eps)
        return h + norm(self.down(self.gelu(self.gate(x)) * self.up(x)), self.post_ffn, a.eps)
