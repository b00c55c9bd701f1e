"""What every speed measurement here shares. All configurations are loaded once and run in one process,
alternating: each round runs every configuration on the same prompt before moving on, and the order rotates
from round to round, so a change of machine load hits all of them alike. Ratios are paired (a configuration
against the backbone of the same round and prompt), summarised by their median with a bootstrap interval,
and rounds are added until every interval is tight enough (or a cap is reached).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def rotation(cfgs: Sequence, r: int) -> list:
    """The order of round r: the configurations rotated by r."""
    k = r % len(cfgs)
    return list(cfgs[k:]) + list(cfgs[:k])


def alternate(cfgs: Sequence, items: Sequence, run: Callable, *, rounds: int, max_rounds: int | None = None,
              settled: Callable[[list[dict]], bool] | None = None, after_round: Callable[[list], None] | None = None,
              say: Callable[[str, int, int], None] = lambda *a: None) -> list[dict]:
    """run(c, item) for every configuration c on every item, in rotating order, for `rounds` rounds, then more
    (up to max_rounds) until settled(rows) holds. after_round(order) runs at the end of each round (e.g. a
    prefill measurement). Returns one row per (round, item): {"round", "item", "results": {c: run(c, item)}}."""
    max_rounds = max(rounds, max_rounds or rounds)
    rows: list[dict] = []
    done, r = 0, 0
    while r < rounds or (r < max_rounds and settled is not None and not settled(rows)):
        order = rotation(cfgs, r)
        for i, item in enumerate(items):
            res = {}
            for c in order:
                res[c] = run(c, item)
                done += 1
                say(f"round {r + 1} (at least {rounds}, at most {max_rounds})", done,
                    max(rounds, r + 1) * len(items) * len(cfgs))
            rows.append({"round": r, "item": i, "results": res})
        if after_round is not None:
            after_round(order)
        r += 1
    return rows


def bootstrap_ci(x, level: float = 0.95, n: int = 2000, seed: int = 0) -> list[float]:
    """Percentile bootstrap interval of the median of x."""
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    med = np.median(rng.choice(x, size=(n, len(x)), replace=True), axis=1)
    return [float(np.quantile(med, (1 - level) / 2)), float(np.quantile(med, (1 + level) / 2))]


def paired(values: Sequence[dict], c, ref="backbone", inverse: bool = False) -> tuple[list[float], float, list[float]]:
    """c's value over ref's in each sample (ref's over c's when inverse: for times), their median and its
    bootstrap 95% interval."""
    r = [(v[ref] / v[c]) if inverse else (v[c] / v[ref]) for v in values]
    return r, float(np.median(r)), bootstrap_ci(r)


def within(values: Sequence[dict], cfgs: Sequence, ci: float, min_samples: int = 5) -> bool:
    """Every configuration's paired ratio known within +-ci of its median (95% bootstrap); fewer than
    min_samples samples say nothing about an interval."""
    if len(values) < min_samples:
        return False
    for c in cfgs:
        _, m, (lo, hi) = paired(values, c)
        if hi - m > ci * m or m - lo > ci * m:
            return False
    return True
