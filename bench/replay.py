"""Levers for exact mode, priced before building them (bench/levers.py; docs/design.md, section 4).

Two measurements and one cost model:
- a draft log from exact mode drafting kmax every cycle: per cycle the river's top-1 probability of each draft and
  how many of them the backbone accepted. Replaying it under another draft-length policy (fixed k, each request's
  own best k, stop after a draft below a confidence, a tree that would rescue every rejection) prices that
  policy with the costs measured in the same process: a cycle drafting k of them yields min(accepted, k) + 1 tokens for k drafts + verify(k + 1).
- the river's teacher-forced agreement with the backbone with some river layers skipped (those whose backbone
  twin changes the hidden state least), from the PyTorch reference: the per-token acceptance a layer-skip draft
  would have, priced at the draft cost scaled by the river bytes it would still read.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from river_edge.runtime.costs import CostModel

LoggedCycle = tuple[Sequence[float], int, int]   # (top-1 probability of each draft, drafts judged, drafts accepted)
EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0001)


def judged(log: Sequence[LoggedCycle]) -> tuple[np.ndarray, np.ndarray]:
    """(confidence, accepted) of every draft the backbone judged on its own: those up to the first rejection."""
    p, a = [], []
    for conf, n_judged, n_acc in log:
        for i, c in enumerate(conf[:n_judged]):
            if i > n_acc:
                break
            p.append(c)
            a.append(i < n_acc)
    return np.array(p), np.array(a, dtype=bool)


def by_confidence(log: Sequence[LoggedCycle], edges: Sequence[float] = EDGES) -> list[dict]:
    p, a = judged(log)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        s = (p >= lo) & (p < hi)
        out.append({"p_from": lo, "p_to": min(hi, 1.0), "drafts": int(s.sum()),
                    "acceptance": float(a[s].mean()) if s.any() else None})
    return out


def _tokens_ms(log, draft_ms, verify_ms, k_of, rescue=False) -> tuple[float, float]:
    tokens = ms = 0.0
    for conf, _, n_acc in log:
        k = max(0, min(k_of(conf), len(conf), len(verify_ms) - 1))
        tokens += (k if rescue else min(n_acc, k)) + 1
        ms += k * draft_ms + verify_ms[k]
    return tokens, ms


def replay(log: Sequence[LoggedCycle], draft_ms: float, verify_ms: Sequence[float], k_of: Callable[[Sequence[float]], int],
           rescue: bool = False) -> float:
    """Tokens per second of the logged cycles drafting k_of(confidences) each (verify_ms[n - 1]: n rows).
    rescue: every draft accepted (the ceiling of a tree that always holds the backbone's token)."""
    tokens, ms = _tokens_ms(log, draft_ms, verify_ms, k_of, rescue)
    return 1e3 * tokens / ms


def per_request(logs: Sequence[Sequence[LoggedCycle]], draft_ms: float, verify_ms: Sequence[float]) -> float:
    """Tokens per second with each request's own best fixed k, chosen knowing its whole log: the ceiling of
    choosing k per request."""
    tokens = ms = 0.0
    for log in logs:
        t, m = max((_tokens_ms(log, draft_ms, verify_ms, lambda c, k=k: k) for k in range(1, len(verify_ms))),
                   key=lambda tm: tm[0] / tm[1])
        tokens, ms = tokens + t, ms + m
    return 1e3 * tokens / ms


def stop_below(tau: float, cap: int) -> Callable[[Sequence[float]], int]:
    """Draft up to cap, stopping after the first draft whose top-1 probability is below tau (it is verified)."""
    def k_of(conf):
        for i, c in enumerate(conf[:cap]):
            if c < tau:
                return i + 1
        return cap
    return k_of


def iid_rate(a: float, draft_ms: float, verify_ms: Sequence[float]) -> tuple[float, int]:
    """(tokens per second, k) of exact mode's own choice of k (runtime/costs.py) at a per-token acceptance a."""
    cm = CostModel(draft_s=draft_ms / 1e3, verify_s=[0.0] + [v / 1e3 for v in verify_ms])
    k = cm.best_k(a, len(verify_ms) - 1)
    return cm.rate(k, a), k


def policies(logs: Sequence[Sequence[LoggedCycle]], draft_ms: float, verify_ms: Sequence[float],
             taus: Sequence[float] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)) -> dict:
    """Every policy replayed over the cycles of all requests (logs: one per request)."""
    log = [c for lg in logs for c in lg]
    kmax = len(verify_ms) - 1
    fixed = {k: replay(log, draft_ms, verify_ms, lambda c, k=k: k) for k in range(1, kmax + 1)}
    kb = max(fixed, key=fixed.get)
    return {
        "backbone_tok_s": 1e3 / verify_ms[0],
        "fixed_k": fixed, "best_fixed_k": kb,
        "stop_below": {cap: {t: replay(log, draft_ms, verify_ms, stop_below(t, cap)) for t in taus}
                       for cap in sorted({kb, kmax})},
        "per_request_ceiling": per_request(logs, draft_ms, verify_ms),
        "tree_ceiling": replay(log, draft_ms, verify_ms, lambda c: kb, rescue=True),
    }


def skip_order(sims: np.ndarray) -> list[int]:
    """Inner layers by mean cosine similarity of their input and output, highest first: the layers a skipping
    draft would drop first (the first and last layer never)."""
    L = len(sims)
    return [int(i) for i in np.argsort(-np.asarray(sims), kind="stable") if 0 < i < L - 1]
