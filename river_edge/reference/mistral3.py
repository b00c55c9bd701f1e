"""Ministral 3 decoder layer: llama's, with Llama 4's attention temperature: q grows with the position's
log-bucket, q *= 1 + temp_scale * log(floor(pos / n_ctx_orig) + 1), where the GGUF sets a temperature scale."""
import torch

from . import llama


class Block(llama.Block):
    def rotate(self, q, k, pos):
        q, k = super().rotate(q, k, pos)
        a = self.args
        if a.temp_scale:
            s = torch.log(torch.floor(pos.double() / a.n_ctx_orig) + 1) * a.temp_scale + 1
            q = q * s.float()[:, None, None]
        return q, k
