"""Gated mode (river_edge/runtime/spec.py): each token from the river; where the river's output entropy reaches the gate,
the backbone decodes the position again and that token stands."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from river_edge.runtime.decoder import Decoder
from river_edge.runtime.sampling import row_entropy
from river_edge.runtime.token import Token


def gated(dec: Decoder, gate: float, st, tokens: list[int], kw: dict, owns: Callable[[], bool]):
    """River step per token; when its entropy >= the gate the backbone re-decodes the position.
    The token comes from llama.cpp's own sampler chain (all settings supported), so gate 0 gives
    the backbone's output and gate +inf the all-river output, seed for seed. `st`: the Spec's Stats; `owns`: whether
    this call still holds the model (Spec.owns)."""
    L = dec.n_layer
    kw = dict(kw)
    stop = kw.pop("stopping_criteria", None)
    reset = kw.pop("reset", True)
    kw.pop("penalize_nl", None)
    sampler = dec.sampler(**{k: v for k, v in kw.items() if k in (
        "top_k", "top_p", "min_p", "typical_p", "temp", "repeat_penalty", "frequency_penalty",
        "presence_penalty", "tfs_z", "mirostat_mode", "mirostat_eta", "mirostat_tau",
        "logits_processor", "grammar")})
    row = dec.prefill(tokens, reset)
    n, n_ctx = dec.n_tokens, dec.n_ctx
    pending = dec.sample(sampler)   # the first token from the backbone's prompt logits
    if stop is not None and stop(dec.history(n), row):
        return
    yield Token(pending, "gated")
    try:
        while n < n_ctx:
            dec.force_exit(-1)
            row = dec.decode([pending], n)[0]
            st.river_steps += 1
            drafted = "river"
            if gate <= 0 or (gate < math.inf and row_entropy(row) >= gate):
                drafted = None
                dec.force_exit(L - 1)
                dec.remove(n)
                row = dec.decode([pending], n)[0]
                st.fallbacks += 1
            dec.accept([pending], n)
            tok = dec.sample(sampler)   # (a logits processor reads the history: pending is in it)
            if stop is not None and stop(dec.history(n + 1), np.array(row)):
                return
            yield Token(tok, "gated", drafted)
            pending, n = tok, n + 1
    finally:
        if owns():   # a stream closed after a later call took the model leaves it alone (Spec.owns)
            dec.force_exit(L - 1)
