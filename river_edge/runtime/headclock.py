"""Head drafting's cost gate: running costs of the drafter's own steps and the speed-up S(k) they model
(headdraft.py drafts; this decides whether and how far).

S(k) = E(k, a) t_plain / (k t_draft + t_head(k)), E(k, a) = (1 - a^k) / (1 - a) tokens per cycle at a per-token
acceptance a. Every cost is the lower median of its last samples, and t_plain is capped by what the drafting cycles
measure themselves, so that drafting is judged against costs taken under the same load.
"""
from __future__ import annotations

import statistics
from collections import deque

COST_WINDOW = 9      # samples of each cost the gate takes the median of
# the least share of a plain step the head rows a draft leaves out must cost for drafting to go on after its probe:
# the gain is at most that share (less the batched head's), and below it the model's own error decides. SmolLM2's
# (15%) edits drafted at a modelled 1.06x and ran at 0.95x the file; the 0.5B (25%) and Gemma (48%) gain (AMD Zen 4)
HEAD_SHARE = 0.2
MARGIN = 1.05        # modelled S a cycle must reach, here and in exact mode's cost model (costs.py): what a cycle
# costs beyond the model (graph rebuilds, removed cells, Python) and the noise of the timings it reads; at 1.0 the
# 0.5B's chat drafted k = 1, a cycle modelled as a hair cheaper than a step, and ran at 0.95x


class Clock:
    """Running costs (seconds) of the drafter's own steps, kept across calls: a plain step, a draft step, the head
    over k rows, the drafting cycles' wall time (this request's), and the drafts' measured acceptance (reported).

    Each cost is the lower median of its last COST_WINDOW samples. A step that rebuilt the graph costs several
    steps, and on a shared machine a step now and then stalls: a running mean took them in (a 290 ms rebuild on the
    1.5B's 35 ms steps kept the gate drafting for a whole run), and drafting that could not pay looked as if it did.
    A median of the last few drops them and still follows a real change.

    The plain step the drafts are weighed against (`plain`) is capped by a draft step plus the head rows it leaves
    out: the full head over one row times the share of the vocabulary outside the trimmed head. Those two are
    measured inside the drafting cycles; the plain steps were taken before drafting began, possibly minutes earlier
    on a machine under another load, and a plain step read high makes any drafting look as if it pays."""

    def __init__(self):
        self.samples: dict = {}   # "step", "draft" or k (the head over k rows) -> its last COST_WINDOW samples
        self.costs: dict = {}     # the same keys -> their lower median (kept current: the gate reads it every step)
        self.cycles = [0.0, 0.0]   # drafting cycles' decayed [wall seconds, tokens emitted], overheads and all
        self.n_step = 0
        self.acc = [0.0, 0.0]   # decayed [accepted, rejected] drafts
        self.left_out = 1.0     # the share of the vocabulary outside the trimmed head (set with its rows)

    @property
    def step(self) -> float | None:
        return self.costs.get("step")

    @property
    def draft(self) -> float | None:
        return self.costs.get("draft")

    @property
    def plain(self) -> float | None:
        """A plain step's cost as drafting is judged against it: the measured step, at most a draft step plus the
        full head's cost over the rows the trimmed head leaves out (both measured while drafting)."""
        if self.step is None or self.draft is None or 1 not in self.costs:
            return self.step
        return min(self.step, self.draft + self.costs[1] * self.left_out)

    @property
    def futile(self) -> bool:
        """The whole head over one row is under HEAD_SHARE of a plain step: no trimmed head of any size saves enough
        on this model and host, so later calls decode plainly from the start, without the drafter's bookkeeping
        (about 2-3% of SmolLM2's 10 ms step in Python alone, which left a call with nothing drafted at 0.97x)."""
        return 1 in self.costs and self.plain is not None and self.costs[1] < HEAD_SHARE * self.plain

    @property
    def head(self) -> dict[int, float]:
        return {k: v for k, v in self.costs.items() if isinstance(k, int)}

    def observe(self, what: str, seconds: float, k: int = 0) -> None:
        key = k if what == "head" else what
        w = self.samples.setdefault(key, deque(maxlen=COST_WINDOW))
        w.append(seconds)
        self.costs[key] = statistics.median_low(w)
        self.n_step += what == "step"

    def forget(self, what: str) -> None:
        """Measure `what` anew (the drafts, after a plain spell: the machine's load may have changed)."""
        self.samples.pop(what, None)
        self.costs.pop(what, None)

    def shift(self, what: str, seconds: float) -> None:
        """Move every sample of `what` by `seconds` (a draft step with more or fewer trimmed rows)."""
        if what in self.samples:
            self.samples[what] = w = deque((x + seconds for x in self.samples[what]), maxlen=COST_WINDOW)
            self.costs[what] = statistics.median_low(w)

    def cycle(self, k: int, seconds: float, tokens: int) -> None:
        """A plain step's decode (k = 0, timed as a draft step is: whole cycles read 31.6 ms for a 19.9 ms step), or a
        drafting cycle's wall time into decayed sums, so that an unlucky cycle weighs as its tokens do."""
        if k == 0:
            self.observe("step", seconds)
        else:
            self.cycles = [0.95 * self.cycles[0] + seconds, 0.95 * self.cycles[1] + tokens]

    def judged(self, agreed: int, rejected: int) -> None:
        self.acc = [0.9 * self.acc[0] + agreed, 0.9 * self.acc[1] + rejected]

    acceptance = property(lambda self: self.acc[0] / sum(self.acc) if sum(self.acc) else None)

    def head_cost(self, k: int) -> float:
        """t_head(k): measured, else a line through the nearest measured sizes (one size: a flat line, so an
        unmeasured larger k looks cheap and gets tried once)."""
        h = self.costs
        if k in h:
            return h[k]
        ks = sorted(x for x in h if isinstance(x, int))
        lo = max((x for x in ks if x < k), default=ks[0])
        hi = min((x for x in ks if x > k), default=ks[-1])
        if lo == hi:
            return h[lo]
        return h[lo] + (h[hi] - h[lo]) * (k - lo) / (hi - lo)

    def best_k(self, kmax: int, a: float) -> int:
        """argmax_k S(k) at acceptance a, 0 (decode plainly) where no k beats a plain step. Two plain steps first (the
        first one pays for a graph rebuild), then a cycle of 4 to measure the drafts and the head."""
        if self.n_step < 2:
            return 0
        if self.draft is None or not self.head:
            return min(4, kmax)
        if self.cycles[1] >= 16 and self.cycles[0] / self.cycles[1] > 0.98 * self.plain:
            return 0   # what the cycles really cost per token, not the model of it, says drafting does not pay
        if 1 in self.costs and self.costs[1] * self.left_out < HEAD_SHARE * self.plain:
            return 0   # too small a share of a step to gain by
        return self.speedup(a, self.draft, kmax)[0]

    def speedup(self, a: float, draft: float, kmax: int) -> tuple[int, float]:
        """(k, S(k)) of the best k at acceptance a; (0, MARGIN) where none beats a plain step by MARGIN."""
        a, plain = min(a, 0.999), self.plain
        best, best_s = 0, MARGIN
        for k in range(1, kmax + 1):
            s = (1 - a ** k) / (1 - a) * plain / (k * draft + self.head_cost(k))
            if s > best_s:
                best, best_s = k, s
        return best, best_s

    def best_rows(self, n_rows: int, n_vocab: int, coverage: dict[int, float], kmax: int) -> int:
        """The trimmed head's size with the best modelled S: a size's acceptance is its measured coverage, its draft
        step the measured one plus or minus its rows' share of what the full head adds to a plain step."""
        if self.draft is None or self.step is None or not self.head:
            return n_rows
        per_row = max(self.plain - self.draft, 0.0) / max(n_vocab - n_rows, 1)
        s = {n: self.speedup(a, self.draft + (n - n_rows) * per_row, kmax)[1] for n, a in coverage.items()}
        best = max(s, key=s.get)
        return best if s[best] > 1.02 * s.get(n_rows, 1.0) else n_rows   # 2% or more, else stay (a resize costs)
