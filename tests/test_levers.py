"""Pricing exact mode's levers from a draft log (bench/replay.py, bench/levers.py): the replay against
hand-computed cycles, and the runtime's draft log against its own statistics."""
from __future__ import annotations

import pytest

from bench import replay as LV
from river_edge.runtime.llama import RiverLlama

# (top-1 probability of each draft, drafts judged, drafts accepted)
LOG = [([0.9, 0.8, 0.2, 0.9], 4, 2), ([0.99, 0.99, 0.99, 0.99], 4, 4), ([0.3, 0.9, 0.9, 0.9], 4, 0)]
DRAFT, VERIFY = 10.0, [100.0, 110.0, 120.0, 130.0, 140.0]   # VERIFY[n - 1]: a batch of n rows


def test_judged_stops_at_the_first_rejection():
    p, a = LV.judged(LOG)
    assert p.tolist() == [0.9, 0.8, 0.2, 0.99, 0.99, 0.99, 0.99, 0.3]
    assert a.tolist() == [True, True, False, True, True, True, True, False]
    bins = {b["p_from"]: b for b in LV.by_confidence(LOG, (0.0, 0.5, 1.0001))}
    assert bins[0.0]["drafts"] == 2 and bins[0.0]["acceptance"] == 0.0
    assert bins[0.5]["drafts"] == 6 and bins[0.5]["acceptance"] == 1.0


def test_replay_prices_each_policy():
    # k = 2: 3 + 3 + 1 tokens for 3 cycles of 2 drafts and a 3-row verification
    assert LV.replay(LOG, DRAFT, VERIFY, lambda c: 2) == pytest.approx(1e3 * 7 / (3 * (20 + 120)))
    # stop after a draft below 0.5 (it is verified): k = 3, 4, 1
    k_of = LV.stop_below(0.5, cap=4)
    assert [k_of(c) for c, _, _ in LOG] == [3, 4, 1]
    assert LV.replay(LOG, DRAFT, VERIFY, k_of) == pytest.approx(1e3 * (3 + 5 + 1) / (160 + 180 + 120))
    # the tree ceiling: every draft accepted
    assert LV.replay(LOG, DRAFT, VERIFY, lambda c: 2, rescue=True) == pytest.approx(1e3 * 9 / 420)
    # each request's own best k: all 4 drafts where every one is accepted, 1 where the first is rejected
    assert LV.per_request([LOG[1:2], LOG[2:]], DRAFT, VERIFY) == pytest.approx(1e3 * (5 + 1) / (180 + 120))
    pol = LV.policies([LOG[:2], LOG[2:]], DRAFT, VERIFY)
    assert pol["backbone_tok_s"] == 10.0 and pol["fixed_k"][2] == pytest.approx(1e3 * 7 / 420)
    assert pol["best_fixed_k"] == max(pol["fixed_k"], key=pol["fixed_k"].get)


def test_iid_rate_and_skip_order():
    assert LV.iid_rate(1.0, DRAFT, VERIFY[:3]) == (pytest.approx(1e3 * 3 / 140), 2)
    assert LV.iid_rate(0.0, DRAFT, VERIFY) == (pytest.approx(10.0), 0)   # nothing accepted: never draft
    assert LV.skip_order([0.1, 0.9, 0.5, 0.95, 0.99]) == [3, 1, 2]         # never the first or last layer


def test_draft_log_matches_the_statistics(tiny_llama):
    ref = RiverLlama(str(tiny_llama), mode="backbone", n_ctx=256, seed=0)
    ex = RiverLlama(str(tiny_llama), mode="exact", n_ctx=256, seed=0)
    ex.decoding.draft_k, ex.decoding.draft_log = 3, []
    prompt = [1, 5, 9, 200]
    want = [t for _, t in zip(range(40), ref.generate(prompt, temp=0.0))]
    got = [t for _, t in zip(range(40), ex.generate(prompt, temp=0.0))]
    assert got == want                                # logging does not change what exact mode writes
    log, s = ex.decoding.draft_log, ex.stats()
    assert len(log) == s["cycles"] > 0
    assert sum(j for _, j, _ in log) == s["drafted"] and sum(a for _, _, a in log) == s["accepted"]
    for conf, j, a in log:
        assert 0 <= a <= j <= len(conf) <= 3 and all(0.0 < c <= 1.0 for c in conf)
