"""The measurement harness: rotating order, adaptive rounds, paired ratios and their intervals."""
from __future__ import annotations

import pytest

from river_edge.measure.harness import alternate, bootstrap_ci, paired, rotation, within


def test_rotation_puts_each_configuration_first_in_turn():
    assert [rotation("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_alternate_runs_every_configuration_on_every_item_in_rotating_order():
    calls, ends = [], []
    rows = alternate(["x", "y"], [10, 20], lambda c, i: calls.append((c, i)) or f"{c}{i}", rounds=2,
                     after_round=ends.append)
    assert calls == [("x", 10), ("y", 10), ("x", 20), ("y", 20), ("y", 10), ("x", 10), ("y", 20), ("x", 20)]
    assert ends == [["x", "y"], ["y", "x"]]
    assert [(r["round"], r["item"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rows[3]["results"] == {"y": "y20", "x": "x20"}


@pytest.mark.parametrize("settle_after, max_rounds, want", [(3, 6, 3), (99, 4, 4), (0, 5, 2)])
def test_alternate_adds_rounds_until_settled_or_capped(settle_after, max_rounds, want):
    rows = alternate(["a"], [0], lambda c, i: 1.0, rounds=2, max_rounds=max_rounds,
                     settled=lambda rs: len(rs) >= settle_after)
    assert rows[-1]["round"] + 1 == want


def test_paired_ratios_and_their_interval():
    values = [{"backbone": 10.0, "m": 20.0}, {"backbone": 5.0, "m": 11.0}, {"backbone": 8.0, "m": 15.2}]
    r, med, (lo, hi) = paired(values, "m")
    assert r == pytest.approx([2.0, 2.2, 1.9]) and med == pytest.approx(2.0) and lo <= med <= hi
    assert paired(values, "m", inverse=True)[1] == pytest.approx(0.5)   # times: the backbone's over m's
    lo, hi = bootstrap_ci([1.0] * 9 + [100.0])
    assert lo == hi == 1.0                                              # the median ignores one outlier


def test_within_needs_enough_samples_and_a_tight_interval():
    tight = [{"backbone": 1.0, "m": 2.0 + 0.001 * i} for i in range(8)]
    loose = [{"backbone": 1.0, "m": 1.0 + i} for i in range(8)]
    assert within(tight, ["m"], 0.05) and not within(tight[:4], ["m"], 0.05) and not within(loose, ["m"], 0.05)


def test_one_grammar_for_configuration_names():
    from river_edge.format import RiverError
    from river_edge.measure.harness import parse_configs

    tau = {"tau=": lambda x: float(x) if 0 <= float(x) <= 1 else float("x")}
    assert parse_configs(" Exact, river ,,exact,tau=0.5", ["exact", "river"], tau) == ["exact", "river", "tau=0.5"]
    assert parse_configs(["river"], ["river"]) == ["river"]
    with pytest.raises(RiverError, match=r"unknown mode 'turbo': use a comma list of exact, river, tau=X"):
        parse_configs("exact,turbo", ["exact", "river"], tau, kind="mode")
    with pytest.raises(RiverError, match="configuration 'tau=2'"):
        parse_configs("tau=2", [], tau)
    with pytest.raises(RiverError, match="no configuration given"):
        parse_configs(" , ", ["river"])
    with pytest.raises(RiverError, match="unknown configuration 'tau='"):   # a prefix alone is no value
        parse_configs("tau=", ["river"], tau)


def test_one_reading_of_mode_and_variant():
    from river_edge.format import RiverError, split_mode

    assert split_mode("exact:river+ngram") == ("exact", "river+ngram")
    assert split_mode("river:lagged") == ("river", "lagged") and split_mode("backbone") == ("backbone", "")
    with pytest.raises(RiverError, match="unknown mode 'prompt-lookup'"):
        split_mode("prompt-lookup:2")
