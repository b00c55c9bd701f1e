"""Head drafting: exact mode's drafter for any GGUF whose LM head is a large share of a step (patches/0017).

The body runs one token at a time, as plain decoding runs it, so every cell it writes is the stock runtime's. Each
step's logits come from a trimmed head, the vocabulary rows the model emits most (FR-Spec, arXiv 2502.14856; ranked
by the model's own greedy text, headrank.py), and their argmax is the next draft. After k steps the full head runs once
over the k stored head inputs: one pass over the head's weights for k rows, on ggml's reference kernels, so each row
has a one-token head's bits and the argmax is the stock runtime's. Drafts stand while they are that argmax; at the
first that is not, the full head's token is emitted and the body steps after it are lost (their cells removed).
A token the trimmed head missed joins its rows.

Cost gate (headclock.py): S(k) = E(k, a) t_plain / (k t_draft + t_head(k)), with E(k, a) = (1 - a^k) / (1 - a)
tokens per cycle for a per-token acceptance a, from timings of the drafter's own steps (kept across calls), and the
cycles' measured wall time per token against a plain step's. A draft stands exactly when the full head's token is among the trimmed rows, so
a is the rows' coverage of the text: counted on every token the request emits, drafted or plain, so that a request
whose text the rows hold (an edit) drafts though the one before it (a chat) did not. Where no k gives S >= MARGIN
the loop decodes plainly (full head, one token per step) and measures the drafts again after IDLE tokens. Greedy
only: with sampling, logits processors or penalties the request goes to the backbone alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from river_edge.runtime.headclock import Clock
from river_edge.runtime.headrank import load_or_build
from river_edge.runtime.sampling import Transform
from river_edge.runtime.token import Token
from river_edge.settings import SETTINGS

IDLE = 64            # plain tokens between tries where drafting did not pay
MISSES = 16          # missed tokens gathered before the trimmed head is rebuilt with them
RESIZE = 128         # verified tokens between reconsiderations of the trimmed head's size


def head_rows(n_vocab: int) -> int:
    """Rows of the trimmed head to start with: 1/16 of the vocabulary, at least 4096 (its text needs thousands)."""
    return min(n_vocab, max(4096, n_vocab // 16))


def row_sizes(n_vocab: int) -> tuple[int, ...]:
    """The sizes the cost gate chooses among: 1/32 to 1/4 of the vocabulary, at least 4096 rows."""
    return tuple(sorted({min(n_vocab, max(4096, n_vocab // d)) for d in (32, 16, 8, 4)}))


class TrimmedHead:
    """The trimmed head's rows on one context: a ranking's first n ids, the request's own tokens and past misses."""

    def __init__(self, dec, ranking: np.ndarray, n_rows: int, sizes=()):
        self.dec, self.ranking, self.n_rows = dec, np.asarray(ranking, dtype=np.int32), int(n_rows)
        self.extra: list[int] = []
        self.ids = np.zeros(0, dtype=np.int32)
        self.fresh = False   # rows set since the last decode: the next one rebuilds the graph
        self.mask = np.zeros(dec.n_vocab, dtype=bool)
        self.always = np.zeros(dec.n_vocab, dtype=bool)      # the request's prompt and past misses: in at any size
        self.place = np.empty(dec.n_vocab, dtype=np.int64)   # each id's place in the ranking
        self.place[self.ranking] = np.arange(len(self.ranking))
        # the sizes whose coverage is counted (the one in use among them)
        self.sizes = np.array(sorted(set(sizes or row_sizes(dec.n_vocab)) | {self.n_rows}))
        self.seen = np.zeros((len(self.sizes), 2))           # decayed [verified tokens a size holds, all of them]

    def observe(self, toks) -> None:
        """Verified tokens (the full head's argmaxes, each in its true context): which sizes would have held them,
        so the acceptance of a size not in use is known too (FR-Spec's coverage, measured on this request's text)."""
        for t in toks:
            held = self.always[t] | (self.place[t] < self.sizes)
            self.seen *= 0.995
            self.seen[:, 0] += held
            self.seen[:, 1] += 1

    def coverage(self) -> dict[int, float]:
        """Each size's share of the verified tokens it held (prior 0.8 worth two tokens)."""
        return {int(n): (h + 1.6) / (t + 2.0) for n, (h, t) in zip(self.sizes, self.seen)}

    @property
    def acceptance(self) -> float:
        """The rows' coverage of the text so far: a draft's chance to stand."""
        return self.coverage()[self.n_rows]

    def begin(self, prompt) -> None:
        """A new request: its prompt's tokens join the rows, and its own text soon outweighs the last ones' (they
        count as two tokens, as the prior does)."""
        self.seen *= min(1.0, 2.0 / max(self.seen[0, 1], 1e-9))
        self.prepare(prompt)

    def prepare(self, more=()) -> np.ndarray:
        """The rows (the ranking's head, then `more` and earlier misses), counted but not set on the context."""
        ids = np.concatenate([self.ranking[: self.n_rows], np.asarray(list(more) + self.extra, dtype=np.int32)])
        ids = ids[(ids >= 0) & (ids < self.dec.n_vocab)]
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]
        self.mask[:] = False
        self.mask[ids] = True
        self.always[:] = False
        self.always[ids[min(self.n_rows, len(self.ranking)):]] = True
        return ids

    def apply(self, more=()) -> bool:
        """Set the rows on the context; False where the head cannot be trimmed (a repacked or device-held head, an
        output bias)."""
        ids = self.prepare(more)
        if self.dec.set_head_rows(ids) != 0:
            return False
        self.ids, self.fresh = ids, True
        return True

    def missed(self, tok: int) -> bool:
        """Note a verified token outside the rows; True when enough gathered that the rows should be rebuilt."""
        if not self.mask[tok]:
            self.mask[tok] = self.always[tok] = True   # counted once; in the rows at any size from the next set on
            self.extra.append(int(tok))
            return len(self.extra) % MISSES == 0
        return False

    def off(self) -> None:
        self.dec.set_head_rows([])
        self.ids = self.ids[:0]


@dataclass
class HeadCycle:
    """One head-drafting cycle at position pos: the kept inputs' logits rows, the tokens it emits."""
    pos: int
    k: int = 0                          # body steps on the trimmed head (0: a plain step)
    rows: np.ndarray | None = None      # full-head logits of each position
    out: list[int] = field(default_factory=list)
    stood: int = 0                      # out[:stood] are drafts that stood, the rest the full head's own
    rebuilt: bool = False               # a plain step right after the trimmed head was cleared: the graph rebuilt
    step_s: float = 0.0                 # a plain step's decode


class HeadDraft:
    """The head drafter (DRAFTERS["head"]): its own cycle, draft -> verify -> accept -> settle, so exact mode runs
    `run` instead of the backbone-batch loop. `n_rows`: the trimmed head's size (None: chosen by the cost gate among
    row_sizes, from head_rows at first)."""

    source, free, needs_river = "head", False, False

    def __init__(self, dec):
        # the clock outlives a call: where drafting does not pay, later calls start plain instead of probing again
        self.dec, self.n_rows, self.head, self.clock = dec, None, None, Clock()
        self.kmax = SETTINGS["kmax"].default   # llm.decoding.kmax from the first call on
        self.idle_limit = IDLE   # doubles after each try that did not pay (up to 16x), back to IDLE when one does

    def run(self, spec, tokens: list[int], kw: dict, me: int, base_generate):
        """Greedy text without logits processors or penalties; else the backbone alone (stats' spec_off says why)."""
        why = ("sampling" if float(kw.get("temp", 0.8)) != 0.0 else
               "logits processors or penalties" if Transform(kw, spec.llm.last_n_tokens_size) else None)
        spec.st.spec_off = why and f"{why} (the head drafter drafts plain greedy text)"
        if not why and self.clock.futile:
            why = spec.st.spec_off = "the LM head is under a fifth of a step here: drafting it cannot pay"
        if why:
            yield from base_generate(tokens, **kw)
            return
        if self.head is None or (self.n_rows and self.head.n_rows != self.n_rows):
            self.head = TrimmedHead(self.dec, load_or_build(spec.llm), self.n_rows or head_rows(self.dec.n_vocab))
        yield from self._cycles(spec, tokens, kw, me)

    def _cycles(self, spec, tokens, kw, me):
        dec, st, stop = self.dec, spec.st, kw.get("stopping_criteria")
        row = dec.prefill(tokens, kw.get("reset", True))
        n, n_ctx = dec.n_tokens, dec.n_ctx
        pending = int(row.argmax())
        if stop is not None and stop(dec.history(n), row):
            return
        yield Token(pending, "exact")
        self.idle, self.trimmed, self.prompt, self.st, self.verified = 0, True, tokens, st, 0
        self.head.begin(tokens)
        self.head.observe([pending])
        self.clock.cycles = [0.0, 0.0]   # what drafting cost per token depends on the text: this request's
        dec.keep_hidden(True)
        n0 = n
        try:
            while n < n_ctx:
                t0, c = time.perf_counter(), HeadCycle(n, k=self.choose_k(spec, st, n_ctx - n))
                self.draft(c, pending) if c.k else self.plain(c, pending)
                dec.accept([pending] + c.out[:-1], n)
                # a drafting cycle's whole cost, Python and all, against a plain step's decode. Not a step that rebuilt
                # the graph: the first after the prompt's batch, or after the trimmed head was cleared (SmolLM2's,
                # about twice a step, had its step cost read 19 ms for 8.6)
                if not (c.rebuilt or n == n0):
                    self.clock.cycle(c.k, c.step_s if c.k == 0 else time.perf_counter() - t0, len(c.out))
                for i, tok in enumerate(c.out):   # settle: emit in order; a stop keeps the tokens before it
                    if stop is not None and stop(dec.history(n + i + 1), c.rows[i]):
                        dec.cut(n + 1 + i)
                        return
                    try:
                        yield Token(tok, "exact", "head" if i < c.stood else None)
                    except GeneratorExit:
                        if spec.owns(me):
                            dec.cut(n + 1 + i)
                        raise
                pending, n = c.out[-1], n + len(c.out)
        finally:
            if spec.owns(me):
                dec.keep_hidden(False)
                self.report(st)
                self.head.off()

    def choose_k(self, spec, st, room: int) -> int:
        """The cost gate's k (a test's fixed `draft_k`), 0 for a plain step; the trimmed head set on first use."""
        self.kmax = spec.kmax   # llm.decoding.kmax: drafts per cycle at most
        self.clock.left_out = 1.0 - (self.head.ids.size or self.head.n_rows) / self.dec.n_vocab
        k = (self.clock.best_k(self.kmax, self.head.acceptance) if spec.draft_k is None else
             spec.draft_k() if callable(spec.draft_k) else spec.draft_k)
        k = min(k, room) if self.trimmed else 0
        if k and not self.head.ids.size:
            self.trimmed = self.head.apply(self.prompt)
            if not self.trimmed:
                st.spec_off = "the LM head cannot be trimmed (a repacked or device-held head, or an output bias)"
                return 0
        return k

    def plain(self, c: HeadCycle, pending: int) -> None:
        """One step on the full head (the trimmed head off): backbone decoding itself."""
        if self.head.ids.size:
            self.head.off()
            c.rebuilt = True
        t0 = time.perf_counter()
        row = self.dec.decode([pending], c.pos)[0]
        c.rows, c.out = row[None], [int(row.argmax())]
        c.step_s = time.perf_counter() - t0   # the decode alone, as a draft step is timed: like against like
        self.verified_text(c.out)
        self.head.missed(c.out[0])   # (gathered for the next rows set)
        self.idle += self.clock.draft is not None
        if self.idle >= self.idle_limit:    # measure the drafts again: the costs may have changed
            self.idle, self.idle_limit = 0, min(2 * self.idle_limit, 16 * IDLE)
            self.clock.forget("draft")
            self.clock.cycles = [0.0, 0.0]

    def draft(self, c: HeadCycle, pending: int) -> None:
        """k body steps on the trimmed head, each step's head input kept; then verify and accept."""
        dec = self.dec
        hs, batch, ts = np.empty((c.k, dec.n_embd), dtype=np.float32), [pending], []
        for i in range(c.k):
            t0 = time.perf_counter()
            r = dec.decode([batch[-1]], c.pos + i)[0]
            hs[i] = dec.hidden()
            batch.append(int(r.argmax()))
            if not self.head.fresh:   # a step that rebuilt the graph is not a draft step's cost
                ts.append(time.perf_counter() - t0)
            self.head.fresh = False
            if dec.is_eog(batch[-1]):   # nothing is drafted past the end of the answer
                c.k, hs = i + 1, hs[:i + 1]
                break
        # not the first step after the rows were set, which rebuilds the graph: a probe's 4 steps averaged it in (the
        # 0.5B's draft step read 20.8 ms for 15), and with k = 1 or 2 a median was that step (SmolLM2's 7.7 ms read 20)
        probe = self.clock.draft is None
        if ts:
            self.clock.observe("draft", float(np.median(ts)))
        if probe and c.k > 1:   # the full head over one row, timed beside the drafts: what a draft step leaves out
            t0 = time.perf_counter()
            dec.head_logits(hs[:1])
            self.clock.observe("head", time.perf_counter() - t0, 1)
        self.verify(c, hs)
        self.accept(c, batch)

    def verify(self, c: HeadCycle, hs: np.ndarray) -> None:
        """The full head over the k kept inputs at once: each row a one-token head's bits."""
        t0 = time.perf_counter()
        c.rows = self.dec.head_logits(hs)
        self.clock.observe("head", time.perf_counter() - t0, c.k)

    def accept(self, c: HeadCycle, batch: list[int]) -> None:
        """Drafts while they are the full head's token, then its own token at the first that is not."""
        g = c.rows.argmax(1)
        j = 0
        while j < c.k and g[j] == batch[j + 1]:
            j += 1
        c.out, c.stood = batch[1:j + 1] + ([int(g[j])] if j < c.k else []), j
        self.clock.judged(j, int(j < c.k))
        if self.clock.cycles[1] >= 16 and self.clock.best_k(self.kmax, self.head.acceptance):
            self.idle_limit = IDLE   # measured, drafting pays: a later plain spell measures again soon
        self.st.cycle("head", c.k, c.k, j)
        self.verified_text(c.out)
        if j < c.k and self.head.missed(int(g[j])):
            self.head.apply(self.prompt)

    def verified_text(self, out: list[int]) -> None:
        """Tokens the full head chose, plain or drafted (before a miss among them joins the rows): the coverage each
        size would have had, and every RESIZE of them the size the cost gate prefers (a size set by hand stays)."""
        self.head.observe(out)
        self.verified += len(out)
        if self.verified >= RESIZE and self.n_rows is None:
            self.verified = 0
            self.resize()

    def resize(self) -> None:
        """The size the cost gate prefers, from the coverage each size would have had on the verified text."""
        h, clock = self.head, self.clock
        n = clock.best_rows(h.n_rows, self.dec.n_vocab, h.coverage(), self.kmax)
        if n != h.n_rows:
            old, h.n_rows = h.n_rows, n
            clock.shift("draft", (n - old) * max(clock.plain - clock.draft, 0.0) / max(self.dec.n_vocab - old, 1))
            h.apply(self.prompt) if h.ids.size else h.prepare(self.prompt)   # on the context only while drafting

    def report(self, st) -> None:
        h = self.head
        ms = lambda s: None if s is None else round(1e3 * s, 3)   # noqa: E731
        st.extra["head"] = {"rows": int(h.n_rows + len(h.extra)), "coverage": h.acceptance,
                            "acceptance": self.clock.acceptance, "step_ms": ms(self.clock.step),
                            "draft_ms": ms(self.clock.draft), "head_ms": {k: ms(v) for k, v in self.clock.head.items()}}
