"""What a draft and a verification cost: the cost model exact mode chooses k by (river_edge/runtime/exact.py), and the
start-up probe that measures it once per process and model.

k = argmax over usable batch sizes of E(k) / (k draft + verify(k + 1)), E(k) = (1 - a^(k+1)) / (1 - a), from the
backbone's batch-cost curve verify(n), each drafter's per-token cost and its running acceptance a. A batch size
is usable when its rows depart from one-token decoding by at most ROUNDING (docs/design.md, section 4).
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from river_edge.runtime.drafters import FREE
from river_edge.runtime.headclock import MARGIN   # the modelled gain a drafting cycle must show, both gates

_COSTS: dict[tuple, "CostModel"] = {}   # per process: Spec.key() (file, how it is loaded, head) -> costs
# a verification batch whose logits depart from one-token decoding by more than this (in logits) is not
# chosen: its near-ties (within 4x the departure) would be settled by one-token decodes so often that it cannot pay
ROUNDING = 0.1
# where batch rows are not invariant, a departure the probe may not see at its own position (flash attention: ggml
# splits a lone row's KV across threads only from 512 cells on) is taken to be at least this, in logits
UNSEEN_ROUNDING = 0.01


@dataclass
class CostModel:
    draft_s: float                      # one river step (1 token), Python included
    verify_s: list[float]               # verify_s[n]: backbone batch of n tokens; [0] unused
    backbone_s: float = 0.0             # one backbone step (= verify_s[1])
    tie: float = 0.0                    # batch rounding: max |logit| change of a row decoded in a batch
    ties: list = field(default_factory=list)      # the same per batch size (x4 headroom); [1] = 0: a one-token decode
    # the largest batch whose rows are one-token rows bit for bit (RiverLlama.exact_batch): None, any; 3 where a
    # repacked layout's batched kernel takes over from 4 rows (larger batches are then not used: the stock runtime's
    # text, not the guard's); 1, none (a GPU, flash attention, invariance off: the guard decides)
    exact_batch: int | None = None
    guard: bool = True   # False: rows that are not exact are never verified (a repacked layout; none exact: k = 0)
    other_s: dict = field(default_factory=dict)   # per-token cost of drafters other than the river
    _obs: dict = field(default_factory=dict)

    def step_s(self, drafter: str = "river") -> float:
        if drafter == "river":
            return self.draft_s
        # a drafter never observed starts at the river's cost; its own cycles correct it within a few
        return self.other_s.get(drafter, 0.0 if drafter in FREE else self.draft_s)

    def observe(self, n: int, dt: float, drafter: str = "river") -> None:
        """Online update from a real cycle: n = 0 a draft step (of `drafter`), n >= 1 a verification of n
        tokens. The median of the last 9 observations (the start-up figure among them): on a shared
        machine single cycles stall for 10x their time now and then, and a mean would chase them."""
        if n >= len(self.verify_s):
            return
        key = ("draft", drafter) if n == 0 else n
        start = self.step_s(drafter) if n == 0 else self.verify_s[n]
        w = self._obs.setdefault(key, deque([start], maxlen=9))
        w.append(dt)
        m = float(statistics.median(w))   # not np.median: its array machinery dwarfs 9 numbers, every cycle
        if n == 0 and drafter == "river":
            self.draft_s = m
        elif n == 0:
            self.other_s[drafter] = m
        else:
            self.verify_s[n] = m

    def curve(self) -> list[float]:
        """verify_s made non-decreasing from the right (a batch never costs more than a bigger one): a
        load spike caught in one size's measurements does not rule that size out."""
        v = list(self.verify_s)
        for n in range(len(v) - 2, 0, -1):
            v[n] = min(v[n], v[n + 1])
        return v

    def rate(self, k: int, a: float, curve: list[float] | None = None, drafter: str = "river") -> float:
        """Expected tokens per second of a cycle drafting k at per-token acceptance a."""
        e = k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
        return e / (k * self.step_s(drafter) + (curve or self.curve())[k + 1])

    def usable(self, n: int) -> bool:
        """A batch of n verifies with one-token arithmetic up to rounding."""
        if n <= 1 or n >= len(self.ties):
            return True
        if self.exact_batch is not None and (self.exact_batch > 1 or not self.guard):
            return n <= self.exact_batch
        return self.ties[n] / 4 <= ROUNDING   # ties carry the x4 headroom

    def exact_k(self, k: int) -> int:
        """A fixed k (draft_k) cut to the largest batch whose rows are exact, where some are."""
        strict = self.exact_batch is not None and (self.exact_batch > 1 or not self.guard)
        return min(k, self.exact_batch - 1) if strict else k

    def best_k(self, a: float, kmax: int, drafter: str = "river") -> int:
        """The k of the best modelled rate, 0 (a plain step) unless that rate beats a plain step's by MARGIN (at 1.0 the
        0.5B's chat drafted n-gram lookups at a modelled break-even and ran at 0.95x the file, AMD Zen 4)."""
        c = self.curve()
        ks = [k for k in range(0, min(kmax, len(self.verify_s) - 2) + 1) if self.usable(k + 1)]
        k = max(ks, key=lambda k: self.rate(k, a, c, drafter))
        return k if self.rate(k, a, c, drafter) >= MARGIN * self.rate(0, a, c, drafter) else 0

    def as_dict(self) -> dict:
        return {"draft_ms": self.draft_s * 1e3, "verify_ms": [v * 1e3 for v in self.verify_s[1:]],
                "verify_ms_used": [v * 1e3 for v in self.curve()[1:]],
                "batch_deviation": [t / 4 for t in self.ties[1:]],
                "usable_batch": [self.usable(n) for n in range(1, len(self.verify_s))], "exact_batch": self.exact_batch,
                **({"other_draft_ms": {k: v * 1e3 for k, v in self.other_s.items()}} if self.other_s else {})}


def cached(key: tuple) -> CostModel | None:
    return _COSTS.get(key)


def probe(dec, tok: int, pos: int, kmax: int, key: tuple, exact_batch: int | None) -> CostModel:
    """Measured once per process (kept under `key`): a river step and backbone batches of 1..kmax+1 at positions
    pos.. of the decoder's model (removed afterwards), and how far each batch's rows depart from one-token decodes.
    `exact_batch`: RiverLlama.exact_batch. Restores the forced exit to the backbone."""
    L = dec.n_layer
    n_full = min(kmax + 1, dec.n_batch)
    n_max = min(n_full, dec.n_ctx - pos)

    def t(fn, reps):
        out = []
        for _ in range(reps + 1):          # the first run of a batch size builds its graph
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            dec.remove(pos)
        return float(min(out[1:]))          # min: robust to a shared machine's spikes

    # every row of a verification batch against the same position decoded alone (as backbone mode
    # decodes): rounding where the batch takes the same kernels, more where ggml switches to its batched
    # ones (k-quants on CPU: up to 0.4 logits from 2-4 rows on)
    single = []
    dev = [0.0] * (n_max + 1)

    # distinct tokens, as a real draft has (a batch of one token repeated can hide the difference)
    ctx = [int(x) for x in dec.history(pos)[max(0, pos - n_max + 1):]]
    seq = ([tok] + ctx[::-1] + [tok] * n_max)[:n_max]

    def verify_step(n):
        rows = dec.verify(seq[:n], pos)
        dev[n] = max(dev[n], max(float(np.abs(rows[i] - single[i]).max()) for i in range(n)))

    try:
        draft = 0.0
        if dec.has_river:   # a river step (a plain GGUF has none; its drafters cost their own)
            dec.force_exit(-1)
            draft = t(lambda: dec.decode([tok], pos).argmax(), 4)
            dec.force_exit(L - 1)
        for i in range(n_max):
            single.append(np.array(dec.decode([seq[i]], pos + i)[0]))
        dec.remove(pos)
        verify = [0.0] + [t(lambda n=n: verify_step(n), 3) for n in range(1, n_max + 1)]
    finally:
        dec.force_exit(L - 1)
        dec.remove(pos)
    verify = [float(v) for v in np.maximum.accumulate(verify)]   # a bigger batch never costs less: noise
    # a top-2 margin within this of a tie may flip between the batch and a one-token decode: such
    # positions are settled by a one-token decode (x4 headroom over what this probe saw)
    exact = exact_batch
    guard = exact is None or exact == 1   # a repacked layout (exact 3) is never guarded: its departing rows go unused
    if exact is not None and exact > 1:   # the probe's own check: a size it saw depart is not exact after all
        exact = next(n for n in range(min(exact, n_max), 0, -1) if not any(dev[2:n + 1]))
    if exact is not None:   # sizes past it may depart where this probe's position did not show it (flash attention
        # splits a lone row's KV only from 512 cells on; a repacked kernel's rounding need not show in every row)
        dev = [d if n <= exact else max(d, UNSEEN_ROUNDING) for n, d in enumerate(dev)]
    ties = [4.0 * d for d in dev]
    cm = CostModel(draft, verify, verify[1], max(ties[1:]), ties=ties, exact_batch=exact, guard=guard)
    if n_max == n_full:   # a probe cut short by the end of the context serves its request only
        _COSTS[key] = cm
    return cm
