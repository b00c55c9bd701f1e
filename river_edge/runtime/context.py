"""A second llama_context on a RiverLlama's model, for measuring several sequences decoded in one batch beside
the model's own context (RiverLlama.batch_context), and the exit histogram both read."""
from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from river_edge import format as F


def exit_histogram_of(lib, ctx, n_layer: int) -> np.ndarray:
    buf = (ctypes.c_int64 * (n_layer + 1))()
    lib.llama_river_get_histogram(ctx, buf, n_layer + 1)
    return np.array(buf, dtype=np.int64)


class RiverContext:
    """A second llama_context on a RiverLlama's model (RiverLlama.batch_context): decode, logits, telemetry."""

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
