"""A second llama_context on a RiverLlama's model, for measuring several sequences decoded in one batch beside the
model's own context (bench/longrun.py's batch study): its parameters and river settings, the rule deciding."""
from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from river_edge import format as F
from river_edge.runtime.capi import exit_histogram_of


class RiverContext:
    """decode, logits, the river's telemetry of a context made by batch_context."""

    def __init__(self, ctx, lib, n_layer: int, n_vocab: int):
        self.ctx, self._lib, self.n_layer, self.n_vocab = ctx, lib, n_layer, n_vocab

    def decode(self, batch) -> None:
        self.ctx.decode(batch)

    def logits(self, i: int) -> np.ndarray:
        """Logits of output row i of the last decode (a view)."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx.ctx, i), shape=(self.n_vocab,))

    @property
    def last_exit(self) -> int | None:
        e = int(self._lib.llama_river_last_exit(self.ctx.ctx))
        return None if e == F.EXIT_NONE else e

    def exit_histogram(self) -> np.ndarray:
        return exit_histogram_of(self._lib, self.ctx.ctx, self.n_layer)

    def reset_stats(self) -> None:
        self._lib.llama_river_reset_stats(self.ctx.ctx)

    def close(self) -> None:
        self.ctx.close()


def batch_context(llm, n_seq: int, n_ctx: int, n_batch: int) -> RiverContext:
    """A second llama_context on `llm`'s model for n_seq sequences in one KV cache: llm's parameters (threads, flash
    attention, K/V types) and river settings (thresholds, min exit layer, head, decision), with the rule deciding."""
    from llama_cpp._internals import LlamaContext

    from river_edge.runtime.capi import _lib
    from river_edge.tokenizer import quiet_llama_logs

    lib = _lib()
    p = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = n_ctx, n_batch, n_batch, n_seq, True
    with quiet_llama_logs():
        ctx = LlamaContext(model=llm._model, params=p, verbose=False)
    c, tau = ctx.ctx, llm.thresholds
    lib.llama_river_set_thresholds(c, (ctypes.c_float * len(tau))(*tau), len(tau))
    lib.llama_river_set_min_exit_layer(c, llm.min_exit_layer)
    if llm.has_river_head:
        lib.llama_river_set_head(c, llm.river_head)
    lib.llama_river_set_enabled(c, True)
    lib.llama_river_set_forced_exit(c, F.EXIT_LAGGED if llm.decide == "lagged" else F.EXIT_RULE)
    return RiverContext(ctx, lib, llm.n_layer, llm.n_vocab())
