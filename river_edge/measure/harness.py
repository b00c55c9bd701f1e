"""What every speed measurement here shares: one grammar for configuration names (parse_configs), one timer
(timed_greedy), and one runner. All configurations are loaded once and run in one process,
alternating: each round runs every configuration on the same prompt before moving on, and the order rotates
from round to round, so a change of machine load hits all of them alike. Ratios are paired (a configuration
against the backbone of the same round and prompt), summarised by their median with a bootstrap interval,
and rounds are added until every interval is tight enough (or a cap is reached).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from river_edge.format import RiverError


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


def timed_greedy(llm, prompt: list[int], n: int, before=None) -> tuple[list[int], float, float]:
    """n greedy tokens after the first (a RiverLlama's as its Tokens: runtime/token.py); (tokens, decode tok/s,
    request seconds). Every configuration is timed from the same two points: the request (prefill included) and the
    first token, which every mode takes from the prompt's logits (exact mode included), to the n-th token after it."""
    llm.reset()
    if before is not None:   # e.g. reset a draft model's own context
        before(llm)
    out, t0 = [], None
    t_req = time.perf_counter()
    for tok in llm.generate(prompt, temp=0.0, reset=True):
        if t0 is None:
            t0 = time.perf_counter()
        else:
            out.append(tok)
        if len(out) >= n:
            break
    t1 = time.perf_counter()
    return out, len(out) / (t1 - t0), t1 - t_req


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


def parse_configs(items: str | Sequence[str], names: Sequence[str],
                  params: dict[str, Callable[[str], object]] | None = None, kind: str = "configuration") -> list[str]:
    """Configuration names, one grammar for every measurement: a comma list (or a sequence) of names, each one of
    `names` or a parameterised one, PREFIX + VALUE for a prefix of `params` ("tau=0.9", "gated@0.25"), whose
    function checks the value (raising RiverError or ValueError). Lower-cased; empty and repeated names dropped.
    An unknown name or a bad value is one line naming it and what is accepted."""
    params = params or {}
    raw = items.split(",") if isinstance(items, str) else list(items)
    out = []
    for c in (str(x).strip().lower() for x in raw):
        if not c:
            continue
        prefix = next((p for p in params if c.startswith(p) and c != p), None)
        if prefix is not None:
            try:
                params[prefix](c[len(prefix):])
            except (RiverError, ValueError) as e:
                raise RiverError(f"{kind} {c!r}: {e}") from None
        elif c not in names:
            accepted = ", ".join([*names, *(f"{p}X" for p in params)])
            raise RiverError(f"unknown {kind} {c!r}: use a comma list of {accepted}")
        out.append(c)
    if not out:
        raise RiverError(f"no {kind} given")
    return list(dict.fromkeys(out))
