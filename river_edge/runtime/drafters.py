"""Who drafts for exact mode: one protocol (Drafter), one table of named drafters (DRAFTERS).

Exact mode's loop (river_edge/runtime/exact.py) is one loop for every drafter: draft k tokens, verify k + 1 on the
backbone in one batch, keep the longest agreeing prefix plus the backbone's own token. The drafters:

  river        the GGUF's own 4-bit twin of every layer (forced exit -1), writing into the shared KV cache
  ngram        prompt lookup (Saxena 2023; llama.cpp's `--lookup`, `ngram` speculation): the tokens that
               followed the most recent earlier occurrence of the context's last n tokens (n = 3, 2, 1).
               Costs no model step, so its k is chosen with a free draft.
  ngram-cache  an n-gram cache (llama.cpp's `lookup` with its context cache): per n-gram, how often each token
               followed it; the draft chains the most frequent continuation of the longest known suffix
  river+ngram  the n-gram continuation where the context has one, the river where it has none (RiverNgram: a
               drafter made of two, not a branch in the loop)
  a GGUF path  a separate draft model with the same vocabulary (e.g. Qwen2.5-Coder-0.5B for the 1.5B), in
               its own context, kept in step with the accepted tokens (DraftModel)

One cost model (costs.py) chooses k for all of them from the measured batch-cost curve, each drafter's
own per-token cost and its own running acceptance, so drafters are compared, not loops.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import llama_cpp
import numpy as np

from river_edge.format import RiverError
from river_edge.runtime.decoder import Decoder
from river_edge.runtime.headdraft import HeadDraft
from river_edge.tokenizer import quiet_llama_logs

NGRAM_MAX = 3


@dataclass
class Offer:
    """What a drafter would draft this cycle, asked before the cost model chooses k."""
    source: str               # who drafts: its name in the cost model and the acceptance counts
    free: bool                # costs no model step (prompt lookup): k is chosen with a free draft
    cap: int | None = None    # at most this many tokens (a lookup's proposals); None: any k


@dataclass
class Context:
    """What a drafter sees of the cycle it drafts for."""
    dec: Decoder              # the target model: its cache holds the kept tokens (the river drafts into it)
    pending: int              # the token the drafts continue: chosen, not yet decoded
    pos: int                  # its position
    # a model's logits row after drafts `so_far` -> (the draft, its top-1 probability): the row through the call's
    # sampler transform, chosen on the noise the backbone will use at that position
    pick: Callable[[np.ndarray, list[int]], tuple[int, float]]
    unsure: float = 0.0       # a model stops after a draft whose top-1 probability is below this

    def history(self) -> list[int]:
        """The kept tokens before `pending`."""
        return list(self.dec.history(self.pos))


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)   # each model draft's top-1 probability (draft_log)
    seconds: float | None = None                        # the model steps' time (the cost model's); None: free


class Drafter(Protocol):
    """Exact mode's drafter. Per generate() call `begin`; per cycle `offer` (who drafts and how many at most, before
    k is chosen), `draft` (k tokens or fewer; an end-of-generation token ends a draft) and `accept` (the tokens the
    cycle emitted: the backbone's). A new drafter is a class with these, registered in DRAFTERS."""

    source: str            # its name in the cost model and the acceptance counts
    free: bool             # costs no model step
    needs_river: bool      # drafts with the GGUF's river

    def begin(self, context: list[int]) -> None:
        """A generate() call starts: `context` holds its prompt and first token."""

    def offer(self, kmax: int) -> Offer: ...

    def draft(self, ctx: Context, k: int) -> Draft: ...

    def accept(self, tokens: list[int]) -> None: ...


class Ngram:
    """Prompt lookup over the tokens of one generate() call (prompt included): an index from every n-gram
    (n = 1..n_max) to where its latest continuation starts, updated as tokens are accepted, so a lookup is
    O(n_max) whatever the context length."""

    source, free, needs_river = "ngram", True, False

    def __init__(self, dec: Decoder | None = None, n_max: int = NGRAM_MAX):
        self.n_max = int(n_max)
        self.begin([])

    def begin(self, context) -> None:
        self.toks: list[int] = []
        self.idx: list[dict] = [{} for _ in range(self.n_max + 1)]
        self._cands: list[int] = []
        self.extend(context)

    def offer(self, kmax: int) -> Offer:
        self._cands = self.propose(kmax)
        return Offer(self.source, True, len(self._cands))

    def draft(self, ctx: Context, k: int) -> Draft:
        out = []
        for d in self._cands[:k]:
            out.append(int(d))
            if ctx.dec.is_eog(d):
                break
        return Draft(out)

    def accept(self, tokens) -> None:
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

    source = "ngram-cache"

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


class ModelDrafter:
    """A model drafting one token at a time, each on the noise the backbone will use there: the river or a separate
    draft model. Subclasses give `prepare` (before a cycle's drafts), `step` (logits after a token) and `done`."""

    free, needs_river = False, False

    def begin(self, context) -> None:
        pass

    def offer(self, kmax: int) -> Offer:
        return Offer(self.source, False)

    def draft(self, ctx: Context, k: int) -> Draft:
        self.prepare(ctx)
        out, x = Draft(), ctx.pending
        t0 = time.perf_counter()
        for i in range(k):
            d, c = ctx.pick(self.step(x, ctx.pos + i), out.tokens)
            out.tokens.append(d)
            out.conf.append(c)
            x = d
            if ctx.dec.is_eog(d) or c < ctx.unsure:
                break
        out.seconds = time.perf_counter() - t0   # the steps alone: a draft model's catch-up is no per-token cost
        self.done()
        return out

    def accept(self, tokens) -> None:
        pass


class RiverDraft(ModelDrafter):
    """The river: the backbone's own cache, every layer on its 4-bit twin (forced exit -1) while drafting, writing
    cells n..n+k-1 that verification replaces."""

    source, needs_river = "river", True

    def __init__(self, dec: Decoder):
        self.dec = dec

    def prepare(self, ctx: Context) -> None:
        self.dec.force_exit(-1)

    def step(self, tok: int, pos: int) -> np.ndarray:
        return self.dec.decode([tok], pos)[0]

    def done(self) -> None:
        self.dec.force_exit(self.dec.n_layer - 1)


class RiverNgram:
    """Prompt lookup's proposals where the context has some, the river's drafts where it has none."""

    source, free, needs_river = "river", False, True

    def __init__(self, dec: Decoder):
        self.lookup, self.river = Ngram(dec), RiverDraft(dec)
        self._by: Drafter = self.river

    def begin(self, context) -> None:
        self.lookup.begin(context)

    def offer(self, kmax: int) -> Offer:
        o = self.lookup.offer(kmax)
        self._by = self.lookup if o.cap else self.river
        return o if o.cap else self.river.offer(kmax)

    def draft(self, ctx: Context, k: int) -> Draft:
        return self._by.draft(ctx, k)

    def accept(self, tokens) -> None:
        self.lookup.accept(tokens)


# Every named drafter: its class, made with the target model's Decoder. A new drafter is registered here.
DRAFTERS: dict[str, Callable[[Decoder], Drafter]] = {
    "river": RiverDraft, "ngram": Ngram, "ngram-cache": NgramCache, "river+ngram": RiverNgram,
    "head": HeadDraft}   # head: a cycle of its own (the full head verifies, not the backbone: headdraft.py)
FREE = frozenset(name for name, cls in DRAFTERS.items() if cls.free)   # sources that cost no model step


class DraftModel(ModelDrafter):
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

    def prepare(self, ctx: Context) -> None:
        """Make its cache hold exactly the kept tokens before the one to draft from (one batch, not per token)."""
        context = ctx.history()
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

    def done(self) -> None:
        pass


def resolve_drafter(drafter, main) -> tuple[str, Drafter]:
    """(name, drafter): a name in DRAFTERS, a GGUF path for a separate draft model ("model"), or any Drafter."""
    if all(hasattr(drafter, a) for a in ("source", "begin", "offer", "draft", "accept")):   # a DraftModel, or one's own
        return "model", drafter
    if isinstance(drafter, str) and drafter.lower() in DRAFTERS:
        return drafter.lower(), DRAFTERS[drafter.lower()](main.decoder)
    if isinstance(drafter, (str, Path)) and str(drafter).endswith(".gguf"):
        return "model", DraftModel(drafter, main)
    raise RiverError(f"unknown drafter {drafter!r}: use {', '.join(DRAFTERS)}, the path of a draft model GGUF or a "
                     "Drafter")

