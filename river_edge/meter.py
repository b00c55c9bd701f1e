"""Per-answer telemetry of a RiverLlama (`river chat`, `river eval`): decode tokens, tok/s, depth, exits.

A `Meter` is a llama-cpp-python logits processor, called once for every sampled token, that notes the time and
the exit layer of the step whose logits it sees. The first sample of an answer sees the prompt's logits
(prefill), so decode speed and depth count the steps after it: depth = mean backbone layers per decoded token
(exit after layer e = e + 1 layers; n_layer = all).
"""
from __future__ import annotations

import time

import numpy as np

from . import format as F


def river_active(llm) -> bool:
    return (bool(getattr(llm, "has_river", False)) and bool(llm.river_enabled)
            and getattr(llm, "mode", None) != "backbone")


class Meter:
    """Per-answer telemetry: decode tokens, tok/s, mean backbone depth, exit histogram.

    Normally a logits processor (`processors()`), called for every sampled token: it notes the time and
    the exit layer of the step whose logits it sees. The speculative modes (exact, gated) decode with
    their own loop, which a logits processor would switch off; there the numbers come from the mode's
    stats() and the runtime's exit histogram (which then counts draft and verify batches too), and
    `tick()` per streamed chunk serves the colours."""

    def __init__(self, llm):
        self.llm = llm
        self.n_layer = int(getattr(llm, "n_layer", 0))
        self.river = river_active(llm)
        self.passive = getattr(llm, "mode", None) in F.LOOP_MODES
        self.times: list[float] = []
        self.exits: list[int] = []  # -1..n_layer-1; n_layer-1 when the backbone ran whole
        # a plain GGUF in exact mode has no river, so no exit histogram: every step ran the whole backbone
        self._histo = self.passive and bool(getattr(llm, "has_river", False))
        if self.passive:
            self._tokens0 = llm.stats()["tokens"]
        if self._histo:
            self._h0 = llm.exit_histogram()

    def processors(self):
        return None if self.passive else [self]

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        self.exits.append(self.exit_now())
        return scores

    def tick(self) -> None:
        if self.passive:
            self.times.append(time.perf_counter())
            self.exits.append(self.exit_now())

    def exit_now(self) -> int:
        if not self.river:
            return self.n_layer - 1
        e = self.llm.last_exit
        return self.n_layer - 1 if e is None else int(e)

    # Processor mode: every sample after the first is a decode step (the first sees the prompt's logits).
    @property
    def decode_exits(self) -> list[int]:
        return self.exits[1:]

    @property
    def samples(self) -> int:
        """Tokens sampled (the end-of-turn token included)."""
        if self.passive:
            return int(self.llm.stats()["tokens"] - self._tokens0)
        return len(self.times)

    def decode_steps(self) -> int:
        return max(self.samples - 1, 0)

    def decode_seconds(self) -> float:
        """From the first sampled token to the last, in every mode (the prompt's prefill is not in it)."""
        if self.passive:
            return float(self.llm.stats()["call_decode_seconds"])
        return self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0

    def tok_s(self) -> float:
        s = self.decode_seconds()
        return self.decode_steps() / s if s > 0 else 0.0

    def histogram(self) -> np.ndarray:
        """counts[e + 1] of decode steps that exited after layer e (the runtime's layout)."""
        if self._histo:
            return (self.llm.exit_histogram() - self._h0).astype(np.int64)
        if self.passive:
            h = np.zeros(self.n_layer + 1, dtype=np.int64)
            h[-1] = self.decode_steps()
            return h
        return np.bincount(np.asarray(self.decode_exits, dtype=np.int64) + 1, minlength=self.n_layer + 1)

    def depth(self) -> float:
        h = self.histogram()
        n = int(h.sum())
        if not n:
            ex = self.exits
            return float(np.mean(ex) + 1) if ex else float(self.n_layer)
        return F.mean_depth(h)
