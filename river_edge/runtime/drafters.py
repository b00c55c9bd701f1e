"""Who drafts for exact mode, and what a draft costs.

Exact mode's loop (river_edge/runtime/spec.py) is one loop for every drafter: draft k tokens, verify k + 1 on the
backbone in one batch, keep the longest agreeing prefix plus the backbone's own token. The drafters:

  river        the GGUF's own 4-bit twin of every layer (forced exit -1), writing into the shared KV cache
  ngram        prompt lookup (Saxena 2023; llama.cpp's `--lookup`, `ngram` speculation): the tokens that
               followed the most recent earlier occurrence of the context's last n tokens (n = 3, 2, 1).
               Costs no model step, so its k is chosen with a free draft.
  ngram-cache  an n-gram cache (llama.cpp's `lookup` with its context cache): per n-gram, how often each token
               followed it; the draft chains the most frequent continuation of the longest known suffix
  river+ngram  the n-gram continuation where the context has one, the river where it has none
  a GGUF path  a separate draft model with the same vocabulary (e.g. Qwen2.5-Coder-0.5B for the 1.5B), in
               its own context, kept in step with the accepted tokens

One cost model (costs.py) chooses k for all of them from the measured batch-cost curve, each drafter's
own per-token cost and its own running acceptance, so drafters are compared, not loops.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import llama_cpp
import numpy as np

from river_edge.format import RiverError
from river_edge.runtime.decoder import Decoder
from river_edge.tokenizer import quiet_llama_logs

NAMED = ("river", "ngram", "ngram-cache", "river+ngram", "head")   # head: headdraft.py, its own loop
FREE = ("ngram", "ngram-cache")      # drafters that cost no model step
NGRAM_MAX = 3
class Ngram:
    """Prompt lookup over the tokens of one generate() call (prompt included): an index from every n-gram
    (n = 1..n_max) to where its latest continuation starts, updated as tokens are accepted, so a lookup is
    O(n_max) whatever the context length."""

    def __init__(self, tokens, n_max: int = NGRAM_MAX):
        self.n_max = int(n_max)
        self.toks: list[int] = []
        self.idx: list[dict] = [{} for _ in range(self.n_max + 1)]
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.toks.append(int(t))
            m = len(self.toks)
            for n in range(1, self.n_max + 1):   # the n-gram ending at m-2 now continues at m-1
                if m - 1 - n >= 0:
                    self.idx[n][tuple(self.toks[m - 1 - n:m - 1])] = m - 1

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the context, from its longest suffix seen before; [] if none."""
        t = self.toks
        for n in range(min(self.n_max, len(t)), 0, -1):
            s = self.idx[n].get(tuple(t[-n:]))
            if s is not None:
                return t[s:s + k]
        return []


class NgramCache(Ngram):
    """Counts instead of the latest occurrence: for every n-gram (n = 1..n_max) how often each token followed
    it; a draft chains the most frequent continuation of the longest suffix seen before (its own drafts
    included), so it can run past the end of any single earlier occurrence."""

    def extend(self, tokens) -> None:
        for t in tokens:
            self.toks.append(int(t))
            m = len(self.toks)
            for n in range(1, self.n_max + 1):
                if m - 1 - n >= 0:
                    c = self.idx[n].setdefault(tuple(self.toks[m - 1 - n:m - 1]), {})
                    c[self.toks[m - 1]] = c.get(self.toks[m - 1], 0) + 1

    def propose(self, k: int) -> list[int]:
        t, out = self.toks, []
        while len(out) < k:
            ctx = (t[-self.n_max:] + out)[-self.n_max:]
            nxt = None
            for n in range(min(self.n_max, len(ctx)), 0, -1):
                c = self.idx[n].get(tuple(ctx[-n:]))
                if c:   # most frequent; ties to the token seen most recently first (dicts keep insertion order)
                    nxt = max(reversed(list(c)), key=c.get)
                    break
            if nxt is None:
                break
            out.append(nxt)
        return out


class Drafter(Protocol):
    """A model that drafts one token at a time for exact mode: the river (RiverDraft) or a separate draft model
    (DraftModel). Prompt lookup (Ngram, NgramCache) proposes whole drafts instead and costs no model step."""

    source: str   # its name in the cost model and the acceptance counts

    def begin(self, context: list[int]) -> None:
        """Before a cycle's drafts; `context`: the tokens before the one drafted from."""

    def step(self, tok: int, pos: int) -> np.ndarray:
        """Logits after `tok` at position `pos`."""

    def end(self) -> None:
        """After a cycle's drafts."""


class RiverDraft:
    """The river: the backbone's own cache, every layer on its 4-bit twin (forced exit -1) while drafting."""

    source = "river"

    def __init__(self, dec: Decoder):
        self.dec = dec

    def begin(self, context: list[int]) -> None:
        self.dec.force_exit(-1)

    def step(self, tok: int, pos: int) -> np.ndarray:
        return self.dec.decode([tok], pos)[0]

    def end(self) -> None:
        self.dec.force_exit(self.dec.n_layer - 1)


# prompt lookup of a drafter name: proposals first, the model's drafts where it has none (river+ngram)
LOOKUP = {"ngram": Ngram, "ngram-cache": NgramCache, "river+ngram": Ngram}


class DraftModel:
    """A separate draft model in its own llama.cpp context (stock: its graph has no river). Before each
    cycle its cache is brought to the accepted tokens (common prefix kept, the rest decoded in one batch);
    its drafts of the last cycle are dropped there."""

    def __init__(self, path: str | Path, main):
        path = Path(path)
        if not path.is_file():
            raise RiverError(f"draft model {path}: no such file")
        cp = main.context_params
        with quiet_llama_logs():
            try:
                self.llm = llama_cpp.Llama(str(path), n_ctx=main.n_ctx(), n_batch=main.n_batch, n_threads=cp.n_threads,
                                           n_threads_batch=cp.n_threads_batch, verbose=False)
            except ValueError as e:
                raise RiverError(f"draft model {path}: llama.cpp cannot load it ({e})") from None
        self.path, self.source = path, f"model:{path}"
        self.dec, ours = Decoder(self.llm), main.decoder
        if self.dec.n_vocab != ours.n_vocab or any(self.dec.token_text(i) != ours.token_text(i)
                                                   for i in range(0, ours.n_vocab, max(1, ours.n_vocab // 512))):
            raise RiverError(f"draft model {path}: its vocabulary is not {main.model_path}'s "
                             f"({self.dec.n_vocab} vs {ours.n_vocab} tokens)")
        self.toks: list[int] = []      # what its cache holds, position by position

    def close(self) -> None:
        self.llm.close()

    def _decode(self, toks: list[int], pos: int) -> np.ndarray:
        return self.dec.decode(toks, pos)[0]

    def begin(self, context: list[int]) -> None:
        self.prepare(context)

    def end(self) -> None:
        pass

    def prepare(self, context: list[int]) -> None:
        """Make its cache hold exactly `context` (the tokens before the one to draft from)."""
        keep = 0
        for a, b in zip(self.toks, context):
            if a != b:
                break
            keep += 1
        self.dec.remove(keep)
        self.toks = self.toks[:keep]
        rest = list(context[keep:])
        for i in range(0, len(rest), self.llm.n_batch):
            chunk = rest[i:i + self.llm.n_batch]
            self._decode(chunk, len(self.toks))
            self.toks += chunk

    def step(self, tok: int, pos: int | None = None) -> np.ndarray:
        """Logits after `tok`, appended at the end of its cache (its own positions: `pos` is the main model's)."""
        row = self._decode([int(tok)], len(self.toks))
        self.toks.append(int(tok))
        return row


def resolve(drafter, main) -> tuple[str, Drafter | None]:
    """(name, draft model): a drafter name, a GGUF path for a separate draft model, or any Drafter."""
    if all(hasattr(drafter, a) for a in ("source", "begin", "step", "end")):   # a DraftModel, or one's own
        return "model", drafter
    if isinstance(drafter, str) and drafter.lower() in NAMED:
        return drafter.lower(), None
    if isinstance(drafter, (str, Path)) and str(drafter).endswith(".gguf"):
        return "model", DraftModel(drafter, main)
    raise RiverError(f"unknown drafter {drafter!r}: use {', '.join(NAMED)}, the path of a draft model GGUF or a Drafter")

