"""Calibration: its damage measurements against real steps, its fit against its target, its output file."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from river_edge.calibration import record as REC, report as REP, rule as RULE, target as T
from river_edge import format as F
from river_edge.format import RiverError
from river_edge.gguf_tools.convert import plain
from river_edge.gguf_tools.reader import open_gguf, value
from river_edge.reference import Policy, RiverModel

PROMPTS = [[5, 77, 120, 3, 64], [9, 8, 7, 6, 5, 4, 3], [100, 101, 102], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def model(tiny_llama):
    return RiverModel(tiny_llama, emulate=False)


def test_clean_exit_damage_is_a_real_forced_step(model):
    """Exiting after e with the river reading the backbone's cache = a forced step on a backbone cache."""
    caches, toks, hid, logits, pos = REC.decode_backbone(model, PROMPTS[:2], 4)
    exits = dict(REC.clean_exits(model, caches, hid, pos, range(model.args.n_layer - 1)))
    for b, p in enumerate(PROMPTS[:2]):
        for step in (0, 3):
            for e, lg in exits.items():
                c = model.new_cache(32)
                model.step([(p + [t[b] for t in toks[:step]], c)], Policy.backbone())
                st = model.step([([toks[step][b]], c)], Policy(forced=e))
                torch.testing.assert_close(st.logits[0][0], lg[b, step], rtol=1e-4, atol=1e-4)
    # and the backbone's own logits are those of the plain decode
    c = model.new_cache(32)
    st = model.step([(PROMPTS[0] + [toks[0][0]], c)], Policy.backbone())
    torch.testing.assert_close(st.logits[0][-1], logits[0, 0], rtol=1e-4, atol=1e-4)


def test_rule_on_recorded_signals_matches_the_model(model):
    """exits_of() (used for fitting) decides as the model's rule does on the same similarities."""
    L = model.args.n_layer
    s = T.Settings(decode_tokens=6, online_tokens=6, batch=4)
    tr, aux = REC.record(model, PROMPTS, s)
    tau = torch.quantile(torch.tensor(tr.sims), 0.5, dim=0).numpy()
    tau[L - 1] = math.inf
    e = RULE.exits_of(tr.sims, tau, 1)
    assert ((e >= 1) & (e <= L - 1)).all() and len(set(e.tolist())) > 1
    ref = list(aux["ref"].values())
    row = 0
    for p, toks, _ in ref:
        c = model.new_cache(64)
        model.step([(p, c)], Policy.backbone())
        for t in toks:
            sims = model.step([([t], c)], Policy.backbone()).sims[0].numpy()
            assert RULE.exits_of(sims[None], tau, 1)[0] == e[row]
            fresh = model.new_cache(64)
            model.step([(p, fresh)], Policy.backbone())
            row += 1
    assert row == len(e)


@pytest.mark.parametrize("fixture, kind", [("tiny_llama", "kl"), ("tiny_llama", "depth"), ("tiny_qwen3", "depth"),
                                           ("tiny_gemma3", "depth")])
def test_calibration_meets_its_target_on_unseen_prompts(request, fixture, tmp_path, kind):
    path = request.getfixturevalue(fixture)
    s = T.Settings(n_prompts=12, decode_tokens=12, online_tokens=48, batch=6)
    model = RiverModel(path, emulate=False)
    L = model.args.n_layer
    probe = RULE.calibrate(model, [list(range(3 + i, 9 + 2 * i)) for i in range(12)], T.Target("depth", L), s)
    river_kl = probe["test"]["all_river"]["kl"]
    assert river_kl > 0
    goal = river_kl / 2 if kind == "kl" else L / 2
    out = tmp_path / "cal.gguf"
    summary = REP.calibrate_file(path, out, T.Target(kind, goal), s)
    test = summary["test"]["rule"]
    # checked online over online_tokens, not the fit's decode_tokens: the rule's own K/V feed later tokens
    assert test["tokens_per_prompt"] == summary["fit_online"]["tokens_per_prompt"] == 48
    assert len(test["kl_quarters"]) == 4
    assert test["depth"] < L  # it exits: the never-exit fallback meets any quality target trivially
    if kind == "kl":
        assert test["kl"] <= goal
    else:
        assert test["depth"] <= goal + 1  # depth is fitted on the fit prompts; unseen ones may differ a little
    r = open_gguf(out)
    assert value(r, F.KEY_CALIBRATED) is True
    th = value(r, F.KEY_THRESHOLDS)
    assert len(th) == L and not any(math.isnan(x) for x in th)
    assert th == pytest.approx(summary["thresholds"])
    stored = json.loads(value(r, F.KEY_FIT_SUMMARY))
    assert stored["test"]["rule"] == json.loads(json.dumps(test))
    assert (tmp_path / "cal.gguf.calibration.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "cal.gguf.calibration.json").read_text())["spearman_per_layer"]
    assert value(open_gguf(path), F.KEY_CALIBRATED) is False  # the input is untouched
    # the gated mode's gate is fitted on the same prompts (a depth target: the default KL) and stored
    g = summary["gate"]
    assert value(r, F.KEY_GATE) == pytest.approx(g["gate_entropy"]) and g["gate_entropy"] >= 0
    assert json.loads(value(r, F.KEY_GATE_SUMMARY)) == json.loads(json.dumps(g))
    assert g["target"]["kind"] == "kl" and g["target"]["value"] == (goal if kind == "kl" else 0.05)
    assert g["test_online"]["tokens_per_prompt"] == 48   # the gate is checked online too
    assert g["target_met_online"] == (g["test_online"]["kl"] <= g["target"]["value"])


def test_calibration_decodes_each_prompt_once(tiny_llama, tmp_path, monkeypatch):
    """The rule's signals and the gate's all-river figures come from one backbone decode of each prompt."""
    decoded = []
    real = REC.decode_backbone
    monkeypatch.setattr(REC, "decode_backbone", lambda m, batch, n, **kw: decoded.extend(batch) or real(m, batch, n, **kw))
    s = T.Settings(n_prompts=4, decode_tokens=4, online_tokens=8, batch=2)
    summary = REP.calibrate_file(tiny_llama, tmp_path / "cal.gguf", T.Target("kl", 0.05), s)
    assert len(decoded) == len(set(map(tuple, decoded))) == s.n_prompts   # each prompt once (it was twice)
    assert summary["gate"]["gate_entropy"] >= 0


def test_a_wider_lockstep_decode_records_the_same(model, monkeypatch):
    """The calibration decodes its fit and test prompts in one lockstep (record.DECODE_WIDTH): each prompt's tokens,
    signals and damage are those of decoding its half alone, s.batch at a time."""
    s = T.Settings(decode_tokens=5, online_tokens=9, batch=2)
    tr, aux = REC.record(model, PROMPTS[:2], s)
    monkeypatch.setattr(REC, "DECODE_WIDTH", 4)
    wide = REC.decode(model, PROMPTS, s)
    assert [len(d.tokens) for d in wide] == [9] * 4 and wide[0].hid.shape[1] == 5
    tr2, aux2 = REC.record(model, PROMPTS[:2], s, decoded=wide[:2])
    for i in (0, 1):
        assert aux2["ref"][i][1] == aux["ref"][i][1]
        torch.testing.assert_close(aux2["ref"][i][2], aux["ref"][i][2], rtol=1e-4, atol=1e-4)
    for f in ("sims", "sims_nomassive", "kl", "agree", "entropy", "prompt_of"):
        np.testing.assert_allclose(getattr(tr2, f), getattr(tr, f), rtol=1e-4, atol=1e-4, err_msg=f)
    for k in aux["gate"]:
        np.testing.assert_allclose(aux2["gate"][k], aux["gate"][k], rtol=1e-4, atol=1e-4, err_msg=k)


def test_online_gated_spans_backbone_and_all_river(model):
    """The gated mode's online check: gate 0 falls back on every token (the backbone: KL 0), gate +inf never
    (all-river with its own K/V: the all-river online figure); between them, between."""
    from river_edge.calibration.gate import online_gated

    s = T.Settings(decode_tokens=4, online_tokens=10, batch=4)
    _, aux = REC.record(model, PROMPTS, s)
    back = online_gated(model, aux["ref"], 0.0, s.batch)
    assert back["fallback_rate"] == 1 and back["kl"] < 1e-6 and back["agreement"] == 1
    river = online_gated(model, aux["ref"], math.inf, s.batch)
    all_river = RULE.online(model, aux["ref"], lambda i, n: Policy(forced=-1), s.batch, prefill=Policy.backbone())
    assert river["fallback_rate"] == 0 and river["kl"] > 1e-3
    assert river["kl"] == pytest.approx(all_river["kl"], rel=1e-5)
    rec = aux["gate"]
    mid = online_gated(model, aux["ref"], float(np.median(rec["entropy"])), s.batch)
    assert 0 < mid["fallback_rate"] < 1 and 0 < mid["kl"] < river["kl"]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_gemma3", "tiny_qwen3"])
def test_online_checks_in_one_pass_equal_the_step_by_step_decode(request, fixture):
    """The online checks decode each prompt's tokens in one pass (parallel.py); they are the step-by-step decode
    (one RiverModel.step per token, the rule deciding per token, K/V written by whichever layer ran): the same
    exits, fallbacks and figures for the rule, random selection, all-river and the gated mode. gemma3: sliding
    windows the tokens outgrow."""
    from river_edge.calibration.gate import online_gated, online_gated_stepwise

    m = RiverModel(request.getfixturevalue(fixture), emulate=False)
    L = m.args.n_layer
    s = T.Settings(decode_tokens=6, online_tokens=20, batch=3)
    tr, aux = REC.record(m, PROMPTS, s)
    ref = aux["ref"]
    tau = np.quantile(tr.sims, 0.5, axis=0)
    tau[L - 1] = np.inf
    cases = {"rule": (RULE.rule_policy(tau, 1), None),
             "random": (lambda: RULE.random_policy(0.5, L, 3), Policy.backbone()),
             "all-river": (lambda i, n: Policy(forced=-1), None)}
    for name, (pol, prefill) in cases.items():
        fresh = pol if name != "random" else None
        one = RULE.online(m, ref, fresh or pol(), s.batch, prefill=prefill)
        steps = RULE.online_stepwise(m, ref, fresh or pol(), s.batch, prefill=prefill)
        for k in ("depth", "kl", "agreement"):
            assert one[k] == pytest.approx(steps[k], rel=1e-4, abs=1e-6), (name, k)
        assert one["kl_quarters"] == pytest.approx(steps["kl_quarters"], rel=1e-4, abs=1e-6), name
        if name == "rule":   # a rule that exits at several depths, so its own K/V mix layers
            assert 1.5 < one["depth"] < L - 0.5
    # gates going down as the gate's fit checks go, each check's first guesses from the last one's entropies
    ents = None
    for gate in (float(np.median(aux["gate"]["entropy"])), float(np.quantile(aux["gate"]["entropy"], 0.3))):
        got = []
        one = online_gated(m, ref, gate, s.batch, guess_from=ents, entropies=got)
        steps = online_gated_stepwise(m, ref, gate, s.batch)
        assert 0 < one["fallback_rate"] < 1
        for k in ("kl", "agreement", "fallback_rate"):
            assert one[k] == pytest.approx(steps[k], rel=1e-4, abs=1e-6), (gate, k, ents is None)
        assert len(got) == len(ref) and all(len(e) == len(t) for e, (_, t, _) in zip(got, ref.values()))
        ents = got


def test_gated_pass_settles_whatever_its_guess(model):
    """The gated fixed point does not depend on its first guesses (none, all, the answer itself); the answer as its
    guess settles each window in one pass, where no guess takes more."""
    from river_edge.calibration.parallel import gated_pass, prefilled

    s = T.Settings(decode_tokens=4, online_tokens=24, batch=4)
    _, aux = REC.record(model, PROMPTS, s)
    gate = float(np.median(aux["gate"]["entropy"]))
    item = list(aux["ref"].values())[0]

    def run(guess):
        (c,) = prefilled(model, [item], Policy.backbone())
        return gated_pass(model, c, item[1], gate, REC.entropy, window=8, guess=guess)

    lg, fall, passes, ent = run(None)
    assert 0 < int(fall.sum()) < len(fall) and torch.equal(fall, ent >= gate)
    for guess in (torch.ones_like(fall), fall, ent >= gate):
        lg2, fall2, passes2, ent2 = run(guess)
        assert torch.equal(fall2, fall)
        torch.testing.assert_close(lg2, lg, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ent2, ent, rtol=1e-4, atol=1e-4)
        if guess is fall:
            assert passes2 == 3 < passes   # 24 tokens, windows of 8


def test_bad_targets_and_inputs(tiny_llama, tmp_path):
    with pytest.raises(RiverError, match="unknown calibration target"):
        T.Target("speed", 1.0)
    with pytest.raises(RiverError, match="out of range"):
        T.Target("kl", float("nan"))
    with pytest.raises(RiverError, match="out of range"):
        T.Target("agreement", 1.5)
    with pytest.raises(RiverError, match="would overwrite the input"):
        REP.calibrate_file(tiny_llama, tiny_llama, T.Target("kl", 0.1))
    base = plain(tiny_llama, tmp_path / "base.gguf", "backbone")
    with pytest.raises(RiverError, match="river"):
        REP.calibrate_file(base, tmp_path / "out.gguf", T.Target("kl", 0.1))


def test_verdict_words_follow_the_numbers():
    from river_edge.calibration.rule import verdict
    from river_edge.calibration.target import Target

    med = {"cosine": -0.02, "river_entropy": 0.83}
    rule, rnd = {"depth": 2.0, "kl": 0.10, "agreement": 0.8}, {"depth": 2.0, "kl": 0.10, "agreement": 0.8}
    v = verdict(med, rule, rnd, degenerate=True, target=Target("kl", 0.05), m=1)
    assert "Degenerate fit: every token exits after layer 1" in v and "does better" not in v
    assert "not met on unseen prompts: 0.1, 0.05 off" in v
    better = verdict(med, dict(rule, kl=0.05), rnd, target=Target("kl", 0.05))
    assert "the rule does better (KL 0.0500 vs 0.1000)" in better and "not met" not in better
    worse = verdict(med, dict(rule, kl=0.2), rnd)
    assert "random token selection does better (KL 0.1000 vs 0.2000)" in worse
    assert "does better" not in verdict(med, rule, rnd)   # equal KL: neither is better


def _trace(sims, kl):
    sims, kl = np.asarray(sims, np.float32), np.asarray(kl, np.float32)
    return REC.Trace(sims=sims, sims_nomassive=sims, kl=kl, agree=(kl == 0).astype(np.float32),
                     entropy=np.zeros_like(sims), prompt_of=np.zeros(len(sims), int))


def test_a_depth_target_nothing_meets_keeps_the_shallowest_rule_not_the_backbone():
    """The backbone meets any quality target and is the worst answer to a depth one: a depth below every rule's
    gives the shallowest rule; online depth inflation tightens the fit as KL inflation does."""
    rng = np.random.default_rng(0)
    L = 6
    sims = rng.uniform(0.5, 1.0, (40, L))
    kl = np.tile(np.linspace(1.0, 0.0, L), (40, 1))
    tr = _trace(sims, kl)
    got = RULE.fit(tr, T.Target("depth", 1.0), "per-layer", 1.0)     # depth 1: exit before layer 1 (none may)
    assert got["clean"]["depth"] == 2.0 and not np.all(np.isinf(got["thresholds"]))
    loose = RULE.fit(tr, T.Target("depth", 4.0), "per-layer", 1.0)
    tight = RULE.fit(tr, T.Target("depth", 4.0), "per-layer", 1.5)   # online runs 1.5x deeper than clean
    assert loose["clean"]["depth"] <= 4.0 and tight["clean"]["depth"] <= 4.0 / 1.5 + 1e-6
    assert RULE.fit(tr, T.Target("kl", 0.0), "per-layer", 1.0)["clean"]["depth"] == L   # quality: the backbone


def test_calibration_settings_are_checked():
    with pytest.raises(RiverError, match="rule"):
        T.Settings(rule="per_layer")


@pytest.mark.parametrize("n_layer, rule", [(1, "per-layer"), (1, "single"), (2, "per-layer"), (2, "single")])
def test_a_model_with_no_layer_to_exit_after_calibrates_to_never_exit(tmp_path, n_layer, rule):
    """One layer (and two, where the min exit layer 1 is the last): no layer the rule may exit after, so calibration
    writes the never-exit thresholds (it crashed: argmax of an empty sequence; the single rule, on an empty
    quantile) with a report that says so."""
    from river_edge.gguf_tools import build_river, write_tiny_model

    river = build_river(write_tiny_model(tmp_path / "m.gguf", "llama", n_layer=n_layer, seed=4), tmp_path / "r.gguf")
    s = T.Settings(n_prompts=2, decode_tokens=2, online_tokens=2, rule=rule, prompts=["What is 1 plus 1?", "Hi"])
    out = tmp_path / "c.gguf"
    summary = REP.calibrate_file(river, out, T.Target("kl", 0.05), s)
    assert all(math.isinf(x) for x in value(open_gguf(out), F.KEY_THRESHOLDS))
    # KL 0 up to float rounding: the online check decodes in one pass what the reference decoded step by step
    assert summary["test"]["rule"]["depth"] == n_layer and summary["test"]["rule"]["kl"] == pytest.approx(0, abs=1e-6)
    assert not summary["degenerate"] and "Degenerate" not in summary["verdict"]
    if n_layer == 1:
        assert "no layer to exit after" in summary["verdict"] and "nan" not in REP.format_summary(summary)
    assert (tmp_path / "c.gguf.calibration.png").is_file()


def test_an_interrupted_calibration_leaves_none_of_its_outputs(tiny_llama, tmp_path, monkeypatch):
    """The GGUF, DST.calibration.json and DST.calibration.png appear together or not at all: a Ctrl-C while the
    figure was drawn left the GGUF and the JSON without it; one between the renames removes those renamed in."""
    from river_edge.gguf_tools import writer
    from river_edge.calibration import figure

    s = T.Settings(n_prompts=2, decode_tokens=2, online_tokens=2, prompts=["What is 1 plus 1?", "Hi"])
    out = tmp_path / "c.gguf"
    outputs = lambda: sorted(p.name for p in tmp_path.iterdir())  # noqa: E731

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(figure, "calibration", interrupted)
        with pytest.raises(KeyboardInterrupt):
            REP.calibrate_file(tiny_llama, out, T.Target("kl", 0.05), s)
    assert outputs() == []

    real = os.replace

    def replace(a, b):   # Ctrl-C just before the GGUF (renamed last) is renamed in
        if Path(b) == out:
            raise KeyboardInterrupt
        real(a, b)
    monkeypatch.setattr(writer.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        REP.calibrate_file(tiny_llama, out, T.Target("kl", 0.05), s)
    assert outputs() == []
    monkeypatch.undo()
    REP.calibrate_file(tiny_llama, out, T.Target("kl", 0.05), s)
    assert outputs() == ["c.gguf", "c.gguf.calibration.json", "c.gguf.calibration.png"]
