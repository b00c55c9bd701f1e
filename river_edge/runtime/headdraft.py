"""Head drafting: exact mode's drafter for any GGUF whose LM head is a large share of a step (patches/0017).

The body runs one token at a time, as plain decoding runs it, so every cell it writes is the stock runtime's. Each
step's logits come from a trimmed head, the vocabulary rows the model emits most (FR-Spec, arXiv 2502.14856; ranked
by the model's own greedy text, vocab.py), and their argmax is the next draft. After k steps the full head runs once
over the k stored head inputs: one pass over the head's weights for k rows, on ggml's reference kernels, so each row
has a one-token head's bits and the argmax is the stock runtime's. Drafts stand while they are that argmax; at the
first that is not, the full head's token is emitted and the body steps after it are lost (their cells removed).
A token the trimmed head missed joins its rows.

Cost gate: S(k) = E(k, a) t_step / (k t_draft + t_head(k)), with E(k, a) = (1 - a^k) / (1 - a) tokens per cycle for
a per-token acceptance a, from timings of this call's own steps. Where no k gives S > 1 the loop decodes plainly
(full head, one token per step) and tries again after IDLE tokens. Greedy only (Spec.generate routes other settings
to the other drafters).
"""
from __future__ import annotations

import time

import numpy as np

KMAX = 8
IDLE = 64            # plain tokens between tries where drafting did not pay
MISSES = 16          # missed tokens gathered before the trimmed head is rebuilt with them


def head_rows(n_vocab: int) -> int:
    """Rows of the trimmed head: 1/16 of the vocabulary, at least 4096 (the model's own text needs a few thousand)."""
    return min(n_vocab, max(4096, n_vocab // 16))


class TrimmedHead:
    """The trimmed head's rows on one context: a ranking's first n ids, the request's own tokens and past misses."""

    def __init__(self, dec, ranking: np.ndarray, n_rows: int):
        self.dec, self.ranking, self.n_rows = dec, np.asarray(ranking, dtype=np.int32), int(n_rows)
        self.extra: list[int] = []
        self.ids = np.zeros(0, dtype=np.int32)
        self.mask = np.zeros(dec.n_vocab, dtype=bool)

    def apply(self, more=()) -> bool:
        """Set the rows (the ranking's head, then `more` and earlier misses); False where the head cannot be
        trimmed (a repacked or device-held head, an output bias)."""
        ids = np.concatenate([self.ranking[: self.n_rows], np.asarray(list(more) + self.extra, dtype=np.int32)])
        ids = ids[(ids >= 0) & (ids < self.dec.n_vocab)]
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]
        if self.dec.set_head_rows(ids) != 0:
            return False
        self.ids = ids
        self.mask[:] = False
        self.mask[ids] = True
        return True

    def missed(self, tok: int) -> bool:
        """Note a verified token outside the rows; True when enough gathered that the rows should be rebuilt."""
        if not self.mask[tok]:
            self.mask[tok] = True   # counted once
            self.extra.append(int(tok))
            return len(self.extra) % MISSES == 0
        return False

    def off(self) -> None:
        self.dec.set_head_rows([])
        self.ids = self.ids[:0]


class Clock:
    """Running costs of this call's steps (seconds): a plain step, a draft step, the head over k rows."""

    def __init__(self):
        self.step = self.draft = None
        self.n_step = 0
        self.head: dict[int, float] = {}
        self.acc = [1.6, 0.4]   # decayed [accepted, rejected] drafts: prior 0.8 worth 2 drafts

    @staticmethod
    def _ema(old, new, w=0.3):
        return new if old is None else (1 - w) * old + w * new

    def observe(self, what: str, seconds: float, k: int = 0) -> None:
        if what == "head":
            self.head[k] = self._ema(self.head.get(k), seconds)
        else:
            setattr(self, what, self._ema(getattr(self, what), seconds))
            self.n_step += what == "step"

    def judged(self, agreed: int, rejected: int) -> None:
        self.acc = [0.9 * self.acc[0] + agreed, 0.9 * self.acc[1] + rejected]

    @property
    def acceptance(self) -> float:
        return self.acc[0] / (self.acc[0] + self.acc[1])

    def head_cost(self, k: int) -> float:
        """t_head(k): measured, else a line through the nearest measured sizes (one size: a flat line, so an
        unmeasured larger k looks cheap and gets tried once)."""
        if k in self.head:
            return self.head[k]
        ks = sorted(self.head)
        lo = max((x for x in ks if x < k), default=ks[0])
        hi = min((x for x in ks if x > k), default=ks[-1])
        if lo == hi:
            return self.head[lo]
        return self.head[lo] + (self.head[hi] - self.head[lo]) * (k - lo) / (hi - lo)

    def best_k(self, kmax: int) -> int:
        """argmax_k S(k), 0 (decode plainly) where no k beats a plain step. Two plain steps first (the first one
        pays for a graph rebuild), then a cycle of 4 to measure the drafts and the head."""
        if self.n_step < 2:
            return 0
        if self.draft is None or not self.head:
            return min(4, kmax)
        a = min(self.acceptance, 0.999)
        best, best_s = 0, 1.0
        for k in range(1, kmax + 1):
            s = (1 - a ** k) / (1 - a) * self.step / (k * self.draft + self.head_cost(k))
            if s > best_s:
                best, best_s = k, s
        return best


def head_exact(spec, tokens: list[int], kw: dict, me: int, head: TrimmedHead):
    """Exact greedy decoding with head drafts; yields tokens as Spec's other loops do."""
    llm, st, dec = spec.llm, spec.st, spec.dec
    stop = kw.get("stopping_criteria")
    row = spec.prompt(tokens, kw.get("reset", True))
    n, n_ctx = llm.n_tokens, llm.n_ctx()
    pending = int(row.argmax())
    if stop is not None and stop(llm.input_ids[:n], row):
        return
    yield pending
    if n >= n_ctx:
        return
    llm.input_ids[n] = pending
    clock, idle, trimmed = Clock(), 0, True   # trimmed: the head can be trimmed (known at the first try)
    dec.keep_hidden(True)
    try:
        while n < n_ctx:
            k = clock.best_k(KMAX) if spec.draft_k is None else (spec.draft_k() if callable(spec.draft_k) else spec.draft_k)
            k = min(k, n_ctx - n) if trimmed else 0
            if k and not head.ids.size:
                trimmed = head.apply(tokens)
                k = k if trimmed else 0
                if not trimmed:
                    st.spec_off = "the LM head cannot be trimmed (a repacked or device-held head, or an output bias)"
            if k == 0:
                # -- a plain step: the full head on this token
                if head.ids.size:
                    head.off()
                t0 = time.perf_counter()
                row = dec.decode([pending], n)[0]
                clock.observe("step", time.perf_counter() - t0)
                out, rows, keep = [int(row.argmax())], row[None], n + 1
                idle += clock.draft is not None
                if idle >= IDLE:    # try drafting again: acceptance or costs may have changed
                    idle, clock.acc, clock.draft = 0, [1.6, 0.4], None
            else:
                # -- draft: k body steps on the trimmed head, each head input kept
                hs = np.empty((k, dec.n_embd), dtype=np.float32)
                batch = [pending]
                t0 = time.perf_counter()
                for i in range(k):
                    r = dec.decode([batch[-1]], n + i)[0]
                    hs[i] = dec.hidden()
                    batch.append(int(r.argmax()))
                    if dec.is_eog(batch[-1]):   # nothing is drafted past the end of the answer
                        k, hs = i + 1, hs[:i + 1]
                        break
                clock.observe("draft", (time.perf_counter() - t0) / k)
                # -- verify: the full head over the k positions at once
                t0 = time.perf_counter()
                rows = dec.head_logits(hs)
                clock.observe("head", time.perf_counter() - t0, k)
                g = rows.argmax(1)
                # -- accept: drafts while they are the full head's token; then its own token
                j = 0
                while j < k - 1 and g[j] == batch[j + 1]:
                    j += 1
                if g[j] != batch[j + 1]:
                    out, agreed = batch[1:j + 1] + [int(g[j])], j
                    clock.judged(j, 1)
                    if head.missed(int(g[j])):
                        head.apply(tokens)
                else:
                    out, agreed = batch[1:k + 1], k
                    clock.judged(k, 0)
                keep = n + len(out)
                st.cycle("head", k, k, agreed)
                dec.remove(keep)   # cells of the drafts after a rejected one
            # -- settle: emit in order; the cache keeps what was emitted before a stop
            llm.input_ids[n:keep] = [pending] + out[:-1]
            llm.n_tokens = keep
            for i, tok in enumerate(out):
                if stop is not None and stop(llm.input_ids[: n + i + 1], rows[i]):
                    spec._cut(n + 1 + i)
                    return
                try:
                    yield tok
                except GeneratorExit:
                    if spec.owns(me):
                        spec._cut(n + 1 + i)
                    raise
            pending, n = out[-1], keep
            if n < n_ctx:
                llm.input_ids[n] = pending
    finally:
        if spec.owns(me):
            dec.keep_hidden(False)
            st.extra["head"] = {"rows": int(head.n_rows + len(head.extra)), "acceptance": clock.acceptance,
                                "step_ms": _ms(clock.step), "draft_ms": _ms(clock.draft),
                                "head_ms": {k: _ms(v) for k, v in sorted(clock.head.items())}}
            head.off()


def _ms(s):
    return None if s is None else round(1e3 * s, 3)
