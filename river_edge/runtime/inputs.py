"""Checks of what a call brings that llama.cpp would die on instead of refusing: token ids outside the vocabulary
(std::out_of_range aborts the process) and grammars that do not parse (a NULL sampler, then a segfault), nest
too deep or that no token can satisfy. The library
(RiverLlama) and `river serve` (before a request takes the model) use these same checks."""
from __future__ import annotations

import numbers
import time

import llama_cpp
import numpy as np

from river_edge.format import RiverError
from river_edge.runtime.grammars import gbnf_problem
from river_edge.tokenizer import quiet_llama_logs


def check_tokens(tokens, n_vocab: int, what: str = "tokens") -> None:
    """Every id a whole number in 0..n_vocab-1; RiverError naming the first that is not."""
    a = np.asarray(tokens)
    if a.size == 0 or (a.dtype.kind in "iu" and a.min() >= 0 and a.max() < n_vocab):
        return   # the common case at numpy's speed: a prompt is checked on every call
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < n_vocab:
            raise RiverError(f"{what}[{i}] = {t!r}: not a token id of this model (0..{n_vocab - 1})")


def grammar_error(llm, text: str) -> str | None:
    """Why a grammar is refused: past the bounds that keep llama.cpp safe (grammars.gbnf_problem, checked first and
    without recursion), or refused by llama.cpp's GBNF parser (its own message); None when it parses."""
    if (why := gbnf_problem(text, llm.n_vocab())) is not None:
        return why
    with quiet_llama_logs() as log:
        s = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, text.encode("utf-8"), b"root")
    if s:
        llama_cpp.llama_sampler_free(s)
        return None
    why = [x.strip() for x in log if "error" in x or "expect" in x] or ["llama.cpp's parser refused it"]
    return f"the grammar does not parse: {why[0]}"


def check_grammar(llm, text: str) -> None:
    if (why := grammar_error(llm, text)) is not None:
        raise RiverError(why)


# Seconds a completion may run (None: no limit); `river serve` sets it. Past it the completion ends as at max_tokens.
time_budget: float | None = None


def token_cap(max_tokens, criteria):
    """Stopping criteria that also end a completion past max_tokens (and three tokens to finish a character):
    llama-cpp-python holds back a token that starts a multi-byte character and skips its max_tokens check while it
    does, so a model writing such bytes without end (random ones do) ran on to the end of the context. With a
    time_budget, also past that many seconds from the call's start (checked after each token)."""
    extra = []
    if max_tokens is not None and max_tokens > 0:
        count = iter(range(max_tokens + 3))
        extra.append(lambda ids, logits: next(count, None) is None)
    if time_budget is not None:
        deadline = time.monotonic() + time_budget
        extra.append(lambda ids, logits: time.monotonic() > deadline)
    if not extra:
        return criteria
    return llama_cpp.StoppingCriteriaList([*(criteria or []), *extra])
