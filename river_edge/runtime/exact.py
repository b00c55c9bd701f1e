"""Exact mode's loop: a drafter proposes k tokens, the backbone verifies k + 1 in one batch, and the longest prefix
it agrees with is kept plus the backbone's own next token. Output = the backbone's. One cycle is four steps, each a
method of ExactCall read top to bottom in `run`: draft, verify, accept, settle.

Exactness
  greedy (temp == 0): each emitted token is argmax of backbone logits computed from a cache holding only
    backbone-written cells (drafted cells are removed before the backbone batch writes them again; the
    rejected ones are removed after). The prompt is evaluated as the stock runtime evaluates it (Llama.eval's
    n_batch chunks, the stock kernels), and so is every one-token step; a verification batch runs on ggml's
    reference kernels (RiverLlama.batch_invariant, patches/0013), which give each row the bits of decoding that
    token alone. The text, and every cell of the cache, is then the stock runtime's (llama_cpp.Llama on the same
    file) by construction; the start-up probe checks it (the cost model's batch_deviation is 0). Where rows still
    depart (batch invariance turned off; weights in a repacked layout whose batched kernel rounds otherwise; flash
    attention; a GPU or rpc-server backend), a position whose top-2 margin is within 4x the rounding the probe
    measured is decoded again alone, as backbone mode decodes it, so the output does not depend on k; the identity
    is then exact up to ties below that bound (the K/V of batched cells still differ in the last bits). Ties break
    as in llama.cpp's greedy sampler (first index).
  sampling (temp != 0): the token at position t is argmax(log p + G(seed, t)), with Gumbel noise G that is a
    pure function of the seed, the position and the token id (sampling.scores: the Gumbel-max trick, an exact
    draw from p). The drafter drafts on the same noise with its own q, and a draft stands exactly when the
    backbone, sampling with that noise, chooses it too (the coupling of speculative sampling by shared
    randomness). p and q are the logits put through the same transform as llama.cpp's sampler chain that
    llama-cpp-python builds (top_k -> top_p -> min_p on the untempered logits, then / temp, softmax; temp < 0:
    plain softmax). Each token is then distributed exactly as backbone sampling with those settings (up to float
    rounding at the top-p / min-p boundaries), and a seed gives one text whatever the draft lengths were (they
    come from timed costs): the same across calls and processes. It is not llama.cpp's sample stream for that
    seed (backbone mode's text for the seed differs).
  The history-dependent parts of the chain (penalties over the last last_n_tokens_size generated tokens, logits
    processors) are applied to every verified row with the history of its position (Transform). A stopping
    criterion sees the history it would see in backbone mode, and the context keeps no token past the last one
    emitted; its logits argument is the backbone's row for that position.

Choosing k: tokens per cycle E(k) = (1 - a^(k+1)) / (1 - a) for a per-token acceptance a (a decayed running
estimate per drafter), cost(k) = k * draft_step + verify(k + 1); k = argmax E/cost over 0..kmax (costs.py). A
cycle drafting with a model stops early after a draft whose top-1 probability is below draft_stop (settings.py: that
draft is still verified).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from river_edge.runtime.costs import CostModel
from river_edge.runtime.drafters import Context, Draft, Offer
from river_edge.runtime.sampling import Transform, agree, margin, processed_probs, scores, top1_prob
from river_edge.runtime.token import Token

PROBE_IDLE = 128          # tokens between probes where no acceptance could make drafting pay


@dataclass
class Cycle:
    """One draft-verify cycle, as its steps fill it in."""
    pos: int                      # the position of batch[0], the pending token (chosen, not yet decoded)
    source: str                   # who drafted: the cost model's and the acceptance counts' name
    k: int                        # drafts asked for
    batch: list[int]              # pending + drafts: what the backbone verifies
    conf: list[float] = field(default_factory=list)   # each model draft's top-1 probability
    rows: np.ndarray | None = None    # the backbone's row per batch token (through the transform)
    scores: np.ndarray | None = None  # what each row's token is the argmax of
    top: np.ndarray | None = None     # each row's token
    out: list[int] = field(default_factory=list)      # emitted: the drafts that stand, then the backbone's own
    judged: int = 0               # drafts the backbone judged
    agreed: int = 0               # of them, equal to its tokens
    proposed: int | None = None   # a free drafter's first proposal where none was drafted (judged for nothing)

    @property
    def drafts(self) -> list[int]:
        return self.batch[1:]

    @property
    def end(self) -> int:
        """The first free position once the cycle is kept."""
        return self.pos + len(self.out)


class ExactCall:
    """One generate() call of exact mode on a Spec (the mode's options, stats and cost model)."""

    def __init__(self, spec, kw: dict):
        self.spec, self.dec, self.drafter = spec, spec.dec, spec.active_drafter
        temp = float(kw.get("temp", 0.8))
        self.greedy = temp == 0.0
        self.sp = dict(temp=temp, top_k=int(kw.get("top_k", 40)), top_p=float(kw.get("top_p", 0.95)),
                       min_p=float(kw.get("min_p", 0.05)))
        self.stop = kw.get("stopping_criteria")
        self.reset = kw.get("reset", True)
        self.seed = None if self.greedy else spec.call_seed()
        self.unit = temp if temp > 0 else 1.0   # a logit's rounding, in sampling scores (logits / temp + noise)
        self.tf = Transform(kw, spec.llm.last_n_tokens_size)
        self.gen: list[int] = []                # tokens generated in this call: the penalties' window
        self.cm: CostModel | None = None
        self.unsure = 0.0

    def run(self, tokens: list[int], me: int):
        """The prompt on the backbone and its first token, then cycles until the context is full, a stopping
        criterion stops the call or the caller closes it (`me`: the call's claim on the model, Spec.owns)."""
        spec, dec = self.spec, self.dec
        row = dec.prefill(tokens, self.reset)
        n, n_ctx = dec.n_tokens, dec.n_ctx
        # the first token from the prompt's own logits, as backbone mode takes it
        row = self.tf(row, dec.history(n), self.gen) if self.tf else row
        pending = int(self.choose(row[None], n)[1][0])
        if self.stop is not None and self.stop(dec.history(n), row):
            return
        self.gen.append(pending)
        yield Token(pending, "exact")
        if n >= n_ctx:
            return
        spec.decode_threads(True)
        try:
            self.cm = spec.costs(pending, n)
            self.drafter.begin([*dec.history(n), pending])
            while n < n_ctx:
                c = self.draft(pending, n)
                self.verify(c)
                self.accept(c)
                self.settle(c)
                self.keep(c)
                if (yield from self.emit(c, me)):
                    return
                self.drafter.accept(c.out)
                pending, n = c.out[-1], c.end
        finally:
            if spec.owns(me):
                dec.force_exit(dec.n_layer - 1)
                spec.decode_threads(False)

    def choose(self, rows: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """The token for positions pos, pos+1, ... from rows of logits, and the scores it is the argmax of: the
        logits (greedy), or the log-probabilities of llama.cpp's chain plus that position's noise (sampling)."""
        if self.greedy:
            return rows, rows.argmax(1)
        s = np.stack([scores(processed_probs(r, **self.sp), self.seed, pos + i) for i, r in enumerate(rows)])
        return s, s.argmax(1)

    # -- 1. draft ---------------------------------------------------------------------------------
    def draft(self, pending: int, n: int) -> Cycle:
        """Who drafts (the drafter's offer), how many (the cost model's k), and the drafts after `pending`."""
        spec = self.spec
        offer = self.drafter.offer(spec.kmax)
        k = self.choose_k(offer, n)
        # k as chosen, unless a draft the model is unsure of comes first (not with a fixed k)
        self.unsure = spec.draft_stop if spec.draft_stop is not None and spec.draft_k is None else 0.0
        ctx = Context(self.dec, pending, n, partial(self.pick, pending, n), self.unsure)
        d = self.drafter.draft(ctx, k) if k else Draft()
        if d.seconds is not None:
            self.cm.observe(0, d.seconds / len(d.tokens), offer.source)
        c = Cycle(n, offer.source, k, [pending, *d.tokens], d.conf)
        if not k and offer.free and offer.cap:   # what a lookup would have drafted: the next token judges it, free
            c.proposed = next(iter(self.drafter.draft(ctx, 1).tokens), None)
        return c

    def choose_k(self, offer: Offer, n: int) -> int:
        spec, cm = self.spec, self.cm
        k = cm.best_k(spec.acceptance_of(offer.source), spec.kmax, offer.source)
        if k == 0 and not offer.free:
            spec.zero_run += 1
            # probe now and then: the acceptance may have changed; rarely where even drafts that are always
            # accepted would not pay at the measured costs (a probe there is pure loss)
            if spec.zero_run >= PROBE_IDLE or (spec.zero_run >= 16 and cm.best_k(1.0, spec.kmax, offer.source)):
                k, spec.zero_run = 1, 0
        else:
            spec.zero_run = 0
        if spec.draft_k is not None:   # a fixed k, but never a batch size whose rows depart where others do not
            k = cm.exact_k(spec.draft_k() if callable(spec.draft_k) else spec.draft_k)
        if offer.cap is not None:
            k = min(k, offer.cap)
        # the verification batch (k + 1 tokens) must fit the context and llama.cpp's n_batch
        return max(0, min(k, self.dec.n_ctx - n - 1, self.dec.n_batch - 1))

    def pick(self, pending: int, n: int, row: np.ndarray, so_far: list[int]) -> tuple[int, float]:
        """A model's draft from its row: seen with the history it would have (acceptance stays high), on the noise
        the backbone will use at that position."""
        if self.tf:
            row = self.tf(row, [*self.dec.history(n), pending, *so_far], self.gen + so_far)
        c = top1_prob(row) if self.unsure or self.spec.draft_log is not None else 1.0
        return int(self.choose(row[None], n + 1 + len(so_far))[1][0]), c

    # -- 2. verify --------------------------------------------------------------------------------
    def verify(self, c: Cycle) -> None:
        """The backbone decodes pending + drafts in one batch, over the river's draft cells."""
        dec = self.dec
        dec.remove(c.pos)
        t0 = time.perf_counter()
        rows = dec.verify(c.batch, c.pos)
        self.cm.observe(len(c.batch), time.perf_counter() - t0)
        if self.tf:   # row i: the history through batch[i], as the sampler would have it there
            rows = np.stack([self.shaped(c, i, rows[i]) for i in range(len(c.batch))])
        c.rows = rows

    def shaped(self, c: Cycle, i: int, row: np.ndarray) -> np.ndarray:
        return self.tf(row, [*self.dec.history(c.pos), *c.batch[:i + 1]], self.gen + c.drafts[:i])

    # -- 3. accept --------------------------------------------------------------------------------
    def accept(self, c: Cycle) -> None:
        """Row i chooses the token at position pos+1+i; a draft stands while it is that token, and the backbone's
        own token follows the last that stands."""
        c.scores, c.top = self.choose(c.rows, c.pos + 1)
        j = agree(c.drafts, c.top)
        c.out = c.drafts[:j] + [int(c.top[j])]
        c.judged, c.agreed = len(c.drafts), j

    # -- 4. settle --------------------------------------------------------------------------------
    def settle(self, c: Cycle) -> None:
        """A near-tie (a top-2 margin within the batch's measured rounding) may be decided by that rounding: decode
        the first such position alone, as backbone mode does, and let its row decide (the rows before it stand)."""
        cm, dec = self.cm, self.dec
        bound = cm.ties[len(c.batch)] if len(c.batch) < len(cm.ties) else cm.tie
        if not bound:
            return
        tie = next((i for i in range(len(c.out)) if margin(c.scores[i], c.top[i]) * self.unit <= bound), None)
        if tie is None:
            return
        self.spec.st.settled += 1
        rows = np.array(c.rows[:tie + 1])
        dec.remove(c.pos + tie)
        rows[tie] = dec.decode([c.batch[tie]], c.pos + tie)[0]
        if self.tf:
            rows[tie] = self.shaped(c, tie, rows[tie])
        c.rows, c.out = rows, c.drafts[:tie] + [int(self.choose(rows[tie:tie + 1], c.pos + 1 + tie)[1][0])]
        # acceptance counts the drafts judged: those through the tie, the one there accepted if the lone row agrees
        # with it (it is emitted as the backbone's own token); the rest go unjudged
        c.judged = min(tie + 1, len(c.drafts))
        c.agreed = tie + (tie < len(c.drafts) and c.out[-1] == c.drafts[tie])

    def emit(self, c: Cycle, me: int):
        """Yield the cycle's tokens; True where a stopping criterion stopped the call. Stopped at a token (by a
        criterion, or the caller closing us), the cache keeps the tokens before it, as backbone decoding leaves it,
        not accepted drafts nobody saw."""
        dec = self.dec
        for i, tok in enumerate(c.out):
            if self.stop is not None and self.stop(dec.history(c.pos + i + 1), c.rows[i]):
                dec.cut(c.pos + 1 + i)
                return True
            self.gen.append(tok)
            try:   # a draft stood where the backbone's token is it (the agreed count of accept and settle)
                yield Token(tok, "exact", c.source if i < len(c.drafts) and tok == c.drafts[i] else None)
            except GeneratorExit:
                if self.spec.owns(me):
                    dec.cut(c.pos + 1 + i)
                raise
        return False

    def keep(self, c: Cycle) -> None:
        """The backbone's cells of pending and the drafts that stand are kept, the rest dropped; the cycle counted."""
        self.dec.accept(c.batch[:len(c.out)], c.pos)
        self.spec.count(c)
        if self.stop is not None:   # the stopping checks' rows outlive the next decode
            c.rows = np.array(c.rows[:len(c.out)])
