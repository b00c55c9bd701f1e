"""Qwen3 decoder layer: qwen2's without biases, with an RMS norm over each head of q and k before RoPE (the
backbone's norms, shared by the river layer as every norm is)."""
from . import llama, qwen2


class Block(qwen2.Block):
    def __init__(self, args, t, il, mats, emulate):
        super().__init__(args, t, il, mats, emulate)
        self.q_norm, self.k_norm = t[f"blk.{il}.attn_q_norm.weight"].w, t[f"blk.{il}.attn_k_norm.weight"].w

    def qk(self, q, k):
        eps = self.args.eps
        return llama.rms_norm(q, self.q_norm, eps), llama.rms_norm(k, self.k_norm, eps)
