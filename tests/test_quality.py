"""Distribution metrics (bench/quality.py) on the tiny river GGUFs: each configuration against the backbone."""
from __future__ import annotations

import shutil

import pytest

pytest.importorskip("llama_cpp")

from bench import quality as Q
from river_edge.format import RiverError  # noqa: E402
from river_edge.gguf_tools.build import set_river_keys  # noqa: E402


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def river_copy(request, tmp_path):
    """A copy (plain files are written beside it) with the rule exiting often: thresholds 0.3 from layer 0."""
    src = request.getfixturevalue(request.param)
    dst = tmp_path / "tiny.river.gguf"
    set_river_keys(src, dst, thresholds=[0.3] * 4, min_exit_layer=0)
    return dst


def test_held_out_texts_alternate_sources():
    t = Q.held_out_texts(4)
    assert [s for s, _ in t] == ["gsm8k", "humaneval", "gsm8k", "humaneval"]
    assert "Answer:" in t[0][1] and "def " in t[1][1] and len({x for _, x in t}) == 4


def test_every_configuration_against_the_backbone(river_copy):
    res = Q.measure_quality(river_copy, ["q4_0", "q8_0", "river", "random", "fast", "gated", "gated-random", "taus", "gates"],
                n_texts=2, max_tokens=20, threads=1)
    c, L = res["configs"], res["n_layer"]
    assert res["positions"] == 2 * 19  # 2 texts of 20 tokens: 19 next-token predictions each
    assert c["backbone"]["kl"] == 0 and c["backbone"]["agreement"] == 1
    for name, d in c.items():
        assert d["positions"] == res["positions"] and d["perplexity"] > 1 and d["kl"] > -1e-6, name
    assert c["q8_0"]["kl"] < c["q4_0"]["kl"] and c["fast"]["kl"] > 1e-3
    # the rule exits (thresholds 0.3), so it is neither the backbone nor all-river
    assert 0 < c["river"]["mean_depth"] < L and c["river"]["kl"] > 0
    assert sum(c["river"]["hist"]) == res["positions"]
    # random draws from the rule's own exit histogram: about the same depth, every token counted
    assert sum(c["random"]["hist"]) == res["positions"]
    assert abs(c["random"]["mean_depth"] - c["river"]["mean_depth"]) < 1.0
    # a tiny random model is near uniform: every river entropy exceeds the default gate (1 nat), so gated
    # falls back on every token and is the backbone; gated-random at its rate 1 too
    g = c["gated"]
    assert g["fallback_rate"] == 1 and g["kl"] < 1e-6
    assert c["gated-random"]["fallback_rate"] == 1 and c["gated-random"]["kl"] < 1e-6
    # the gate sweep: falling back on about the asked share of tokens (the gate is the quantile of fast's
    # teacher-forced entropies; gated's own K/V move them a little), next to random at the reached rate:
    # a binomial draw over the positions, within 4 standard deviations
    n = res["positions"]
    for r in Q.GATE_RATES:
        g, gr = c[f"gated@{r}"], c[f"gated-random@{r}"]
        assert abs(g["fallback_rate"] - r) < 0.15 and g["kl"] <= c["fast"]["kl"] + 1e-6
        sd = (g["fallback_rate"] * (1 - g["fallback_rate"]) / n) ** 0.5
        assert abs(gr["fallback_rate"] - g["fallback_rate"]) <= 4 * sd + 1 / n and gr["gate_entropy"] is None
    taus = [k for k in c if k.startswith("tau=")]
    assert taus and res["taus"] == sorted(res["taus"])
    depths = [c[k]["mean_depth"] for k in taus]
    assert depths == sorted(depths)  # a higher threshold exits later
    assert "q4_0" in Q.format_table(res)


def test_at_infinite_thresholds_the_rule_is_the_backbone(tiny_llama, tmp_path):
    dst = tmp_path / "t.river.gguf"
    shutil.copy(tiny_llama, dst)
    res = Q.measure_quality(dst, ["river"], n_texts=2, max_tokens=16, threads=1)
    r, b = res["configs"]["river"], res["configs"]["backbone"]
    assert r["kl"] < 1e-6 and r["agreement"] == 1 and r["perplexity"] == pytest.approx(b["perplexity"], rel=1e-6)
    assert r["mean_depth"] == res["n_layer"]


def test_bad_configuration(tiny_llama, tmp_path):
    with pytest.raises(RiverError, match="unknown configuration 'q3'"):
        Q.measure_quality(tiny_llama, ["q3"])
    dst = tmp_path / "t.river.gguf"
    shutil.copy(tiny_llama, dst)
    with pytest.raises(RiverError, match="random needs river first"):
        Q.measure_quality(dst, ["random"], n_texts=1, max_tokens=8, threads=1)
