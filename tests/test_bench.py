"""The benchmark engine (river_edge.measure.bench) and `river bench`, end to end on the tiny llama river GGUF.

Shapes and sanity only: no timing assertions (the speed targets live in the benchmark's output).
One thread, one round, a few tokens: the tiny model decodes in well under a millisecond per token.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from river_edge.gguf_tools.convert import plain

from river_edge.measure import bench as B
from river_edge.measure import files as BF
from river_edge.measure import records as R
from river_edge.measure import plots as P
from river_edge.format import RiverError
from river_edge.cli.main import app

SHORT = ["What is 2 plus 2?", "Write a function."]
MAIN = ("backbone", "plain-f16", "river", "all-river", "q8_0", "q4_0")


@pytest.fixture
def river_copy(tiny_llama, tmp_path):
    """The fixture is read-only and the bench writes its plain files next to the river GGUF."""
    dst = tmp_path / "tiny.river.gguf"
    shutil.copy(tiny_llama, dst)
    return dst


def test_sweep_layers():
    assert B.sweep_layers(30) == [0, 7, 15, 22, 29]
    assert B.sweep_layers(24) == [0, 6, 12, 18, 23]
    assert B.sweep_layers(4) == [0, 1, 2, 3]


def test_packaged_prompts_mix_sources():
    p = BF.packaged_prompts(4)
    assert len(p) == 4 and len(set(p)) == 4
    assert any("def " in x or "function" in x.lower() for x in p)  # the code prompts are in the mix


def test_engine_end_to_end(river_copy, tmp_path):
    res = B.run_bench(river_copy, threads=1, tokens=3, rounds=1, prompts=SHORT, prefill_tokens=40, prefill_reps=1)
    L = res["n_layer"]
    assert L == 4
    assert set(MAIN) <= set(res["configs"])
    assert [s["exit"] for s in res["sweep"]] == B.sweep_layers(L)  # sweep points ordered
    assert [s["backbone_layers"] for s in res["sweep"]] == [e + 1 for e in B.sweep_layers(L)]
    for name, r in res["configs"].items():
        for k in ("decode_tps", "decode_ratio", "prefill_tps", "prefill_ratio", "decode_ms_per_token"):
            assert r[k] > 0 and math.isfinite(r[k]), (name, k)
        assert r["samples"] == len(SHORT)
        if r["river_on"]:
            assert 0 <= r["mean_depth"] <= L
            assert sum(r["exit_histogram"]) == len(SHORT) * 3  # every decode ubatch counted once
            assert 0 <= r["decision_share"] < 1
    assert res["configs"]["backbone"]["decode_ratio"] == 1.0
    assert res["configs"]["all-river"]["mean_depth"] == 0
    # the tiny river GGUF is uncalibrated (thresholds +inf): the rule never exits
    assert res["configs"]["river"]["mean_depth"] == L
    for s in res["sweep"]:  # a forced exit after layer e runs e + 1 backbone layers
        assert s["mean_depth"] == s["backbone_layers"]
        assert s["ratio_to_ideal"] > 0 and s["ideal_ms_per_token"] > 0
    for name in MAIN:
        mem = res["configs"][name]["memory"]
        assert "error" not in mem, mem
        assert mem["peak_mib"] >= mem["after_load_mib"] >= mem["baseline_mib"] > 0
    assert set(res["targets"]) == {"sweep_within_5pct_of_ideal", "decision_share", "prefill_river_vs_backbone"}
    # the sweep target is what its points say (each within 5% of the ideal line, the worst one named)
    sw = res["targets"]["sweep_within_5pct_of_ideal"]
    for s in res["sweep"]:
        assert s["within_5pct"] == (abs(s["ratio_to_ideal"] - 1) <= B.TARGET_SWEEP), s
    assert sw["met"] is all(s["within_5pct"] for s in res["sweep"])
    assert sw["worst_ratio"] == max((s["ratio_to_ideal"] for s in res["sweep"]), key=lambda r: abs(r - 1))
    # uncalibrated: the rule tests no layer, so its targets are not claimed either way
    assert res["targets"]["decision_share"]["met"] is None
    assert res["targets"]["prefill_river_vs_backbone"]["met"] is None
    assert res["method"]["threads"] == 1 and res["method"]["prompts"] == SHORT
    assert len(res["machine"]["load_before"]["loadavg_1_5_15"]) == 3
    # the plain files sit next to the river GGUF and are reused
    for f in ("tiny.backbone.gguf", "tiny.plain.q8_0.gguf", "tiny.plain.q4_0.gguf"):
        assert (river_copy.parent / f).is_file()

    j, png = R.write_record(res, tmp_path / "out", "runtime_tiny", P.runtime)
    data = json.loads(j.read_text())  # strict JSON: no Infinity/NaN tokens
    assert data["configs"]["river"]["decode_tps"] == res["configs"]["river"]["decode_tps"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = B.format_bench(res)
    assert "all-river" in table and "exit" in table and "target" in table


def test_engine_rejects_a_base_gguf(tiny_llama_base, tmp_path):
    src = tmp_path / "base.gguf"
    shutil.copy(tiny_llama_base, src)
    with pytest.raises(RiverError, match="not a river GGUF"):
        B.run_bench(src, threads=1, tokens=2, rounds=1, prompts=SHORT[:1], memory=False)



def test_cli_bench(runner, river_copy, tmp_path):
    out = tmp_path / "results"
    r = runner.invoke(app, ["bench", str(river_copy), "--quick", "--threads", "1", "--tokens", "3", "--out", str(out)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 0, r.output
    for k in ("backbone", "all-river", "q4_0", "exit@3", "ideal"):
        assert k in r.stdout
    data = json.loads((out / "bench_tiny.json").read_text())
    assert data["method"]["decode_tokens"] == 3 and data["method"]["rounds"] == 1
    assert (out / "bench_tiny.png").is_file()


def test_cli_bench_errors(runner, tiny_llama_base, tmp_path):
    r = runner.invoke(app, ["bench", str(tmp_path / "missing.gguf")])
    assert r.exit_code == 1 and "river: error:" in r.stderr
    r = runner.invoke(app, ["bench", str(tiny_llama_base), "--quick"])
    assert r.exit_code == 1 and "river" in r.stderr
    r = runner.invoke(app, ["bench", "--threads", "0"])
    assert r.exit_code == 2


# -- decoding modes (river_edge.measure.modes, `river bench --mode`) -------------------------------------

def test_modes_bench_end_to_end(river_copy, tmp_path, monkeypatch):
    from river_edge.measure import modes as M
    from river_edge.runtime import spec

    # exact mode drafts 2 tokens every cycle: on the tiny model its cost model may rightly draft nothing, and an
    # exact run that drafted nothing is the backbone's own decode, exact whatever verification does
    init = spec.Spec.__init__

    def drafting(self, *a, **kw):
        init(self, *a, **kw)
        self.draft_k = 2
    monkeypatch.setattr(spec.Spec, "__init__", drafting)

    modes = M.parse_modes("exact,exact:ngram,exact:draft,gated,river,fast,backbone,q4_k_m")
    draft = plain(river_copy, tmp_path / "draft.gguf", "river")     # the river's weights as a separate model
    res = M.run_modes(river_copy, modes, threads=1, tokens=6, rounds=2, max_rounds=2, prompts=SHORT, draft=draft)
    cs = res["configs"]
    assert list(cs) == ["backbone", "exact", "exact:ngram", "exact:draft", "gated", "river", "fast", "q4_k_m"]
    assert len(res["rows"]) == 2 * len(SHORT) and res["rounds"] == 2
    for c in ("exact:ngram", "exact:draft"):     # every drafter through the same loop: the backbone's tokens
        assert cs[c]["identical_runs"] == cs[c]["runs"] == 4
    assert cs["exact:draft"]["by_drafter"][f"model:{draft}"]["cycles"] > 0    # the draft model was asked
    assert cs["exact:draft"]["file_mib"] > cs["exact"]["file_mib"]           # both files count
    for c in cs.values():      # peak memory of each configuration in a fresh process
        assert "error" not in c["memory"] and c["memory"]["peak_mib"] >= c["memory"]["after_load_mib"] > 0
        lo, hi = c["ratio_ci95"]
        assert lo <= c["ratio_median"] <= hi
    assert cs["backbone"]["ratio_median"] == 1.0
    # exactness: every run of exact mode gives the backbone's tokens; river at +inf thresholds is the backbone
    assert cs["exact"]["identical_runs"] == cs["exact"]["runs"] == 4
    assert cs["river"]["identical_runs"] == 4 and cs["river"]["mean_depth"] == 4
    for c in ("exact", "exact:draft"):   # and each drafted: the text above came through verification
        e = cs[c]
        assert e["mean_draft_len"] > 0 and 0 <= e["acceptance_rate"] <= 1, (c, e)
    assert cs["exact"]["mean_draft_len"] > 1   # 2 a cycle (the river always has a draft), fewer at the end
    assert 0 <= cs["gated"]["fallback_rate"] <= 1
    for name, c in cs.items():   # the summaries are those of the rows measured
        assert c["tok_s_median"] == pytest.approx(float(np.median([r["tok_s"][name] for r in res["rows"]])))
        assert c["common_prefix_mean"] == pytest.approx(float(np.mean([r["common_prefix"][name] for r in res["rows"]])))
    assert "q4_k_m" in M.format_modes(res)


def test_modes_bench_adds_rounds_until_the_intervals_settle(river_copy, monkeypatch):
    """Rounds beyond the minimum are run while an interval is wider than +-ci, and stop at max_rounds."""
    from river_edge.measure import modes as M

    res = M.run_modes(river_copy, ["exact"], threads=1, tokens=3, rounds=1, max_rounds=3, ci=1e-9, prompts=SHORT[:1],
                memory=False)
    assert res["rounds"] == 3 and res["settled"] is False     # an interval of +-1e-9 never settles
    res = M.run_modes(river_copy, ["exact"], threads=1, tokens=3, rounds=2, max_rounds=9, ci=100.0, prompts=SHORT[:1],
                memory=False)
    assert res["rounds"] == 5 and res["settled"] is True      # 5 samples at least make an interval


def test_modes_bench_shipped_file(river_copy, tiny_llama_base, monkeypatch):
    """`shipped` times the file the river was built from, run by stock code; a river whose source file is
    not in the cache gets one clear error."""
    from river_edge.measure import modes as M

    with pytest.raises(RiverError, match="shipped: the file this river GGUF was built from"):
        M.run_modes(river_copy, M.parse_modes("shipped,q8_0"), threads=1, tokens=3, rounds=1, prompts=SHORT[:1])
    assert sorted(p.name for p in river_copy.parent.iterdir()) == [river_copy.name]   # refused before writing
    monkeypatch.setattr(BF, "source_model", lambda info: "smollm2-135m")
    monkeypatch.setattr(BF.zoo, "is_prepared", lambda name: name == "smollm2-135m")
    monkeypatch.setattr(BF.zoo, "model_path", lambda name: Path(tiny_llama_base))
    res = M.run_modes(river_copy, M.parse_modes("shipped,exact"), threads=1, tokens=4, rounds=1, max_rounds=1,
                prompts=SHORT[:1], memory=False)
    assert list(res["configs"]) == ["backbone", "shipped", "exact"]
    assert res["files"]["shipped"] == str(tiny_llama_base)
    assert res["configs"]["shipped"]["file_mib"] == pytest.approx(Path(tiny_llama_base).stat().st_size / 2**20)
    assert res["configs"]["shipped"]["tok_s_median"] > 0 and "shipped" in M.format_modes(res)


def test_draft_model_download_reports_through_the_bench_progress(river_copy, tiny_llama_base, monkeypatch):
    """exact:draft's default draft model is prepared on first use: the zoo's one-line messages reach a bench's
    (what, done, total) progress instead of failing on its signature."""
    from river_edge.measure import modes as M

    said = []

    def prepare(name, progress=None):
        progress(f"{name}: downloading", 0, 0)
        return Path(tiny_llama_base)

    monkeypatch.setattr(BF, "source_model", lambda info: "qwen2.5-coder-1.5b")
    monkeypatch.setattr(BF.zoo, "prepare", prepare)
    assert M.draft_for(river_copy, None, lambda *a: said.append(a)) == Path(tiny_llama_base)
    assert said == [("qwen2.5-coder-0.5b: downloading", 0, 0)]


def test_modes_bench_cli(river_copy, runner, tmp_path):
    r = runner.invoke(app, ["bench", str(river_copy), "--mode", "exact,fast", "--quick", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "bench_modes_tiny.json").read_text())
    assert list(res["configs"]) == ["backbone", "exact", "fast"] and res["tokens"] == 12
    assert not list(river_copy.parent.glob("*.backbone.gguf"))   # no plain configuration: no backbone copy
    assert (tmp_path / "bench_modes_tiny.png").stat().st_size > 1000
    bad = runner.invoke(app, ["bench", str(river_copy), "--mode", "exact,turbo"])
    assert bad.exit_code == 2 and "unknown mode 'turbo'" in bad.output and "Traceback" not in bad.output


def test_decode_follows_the_models_own_greedy_tokens(river_copy):
    """The timed decode feeds back the argmax of the real logits (not Llama.scores, which only
    logits_all fills), so the river sees the text it would generate."""
    m = B._load(river_copy, 128, 1)
    prompt = [1, 5, 9, 200]
    got = B._decode(m, B.Config("backbone", "river"), prompt, 8)["tokens"]
    m.reset()
    want = [t for _, t in zip(range(9), m.generate(prompt, temp=0.0))]
    assert got == want[1:] and len(set(got)) > 1


def test_backbone_is_the_river_off_in_both_engines(river_copy):
    """One meaning of "backbone": the laptop bench's configuration and the mode bench's mode both run the river GGUF
    with the river off (the stock graph), and each mode[:variant] sets what its variant names."""
    from river_edge.measure import modes as M

    m = B._load(river_copy, 128, 1)
    B._apply(m, B.Config("backbone", "river"))
    laptop = m.river_enabled
    m.river_enabled = True
    M.configure(m, "backbone")
    assert not laptop and not m.river_enabled and m.mode == "backbone"
    M.configure(m, "river:lagged")
    assert m.river_enabled and (m.mode, m.decide) == ("river", "lagged")
    M.configure(m, "exact:ngram")
    assert (m.mode, m.drafter, m.decide, m.batch_invariant) == ("exact", "ngram", "sync", True)
    M.configure(m, "exact:no-invariance")
    assert (m.drafter, m.batch_invariant) == ("river", False)
    with pytest.raises(RiverError, match="unknown mode 'turbo' in 'turbo:x'"):
        M.configure(m, "turbo:x")


def test_a_users_file_named_like_a_plain_file_is_neither_used_nor_replaced(river_copy, tiny_llama_base, runner, tmp_path):
    """A user's base GGUF named m.backbone.gguf, built into m.river.gguf: bench derived its plain files over it
    (the build's input replaced by an F16 upcast). Now it is refused by name, the file untouched; the files bench
    does write carry its mark and are reused."""
    from river_edge.gguf_tools.reader import open_gguf, value
    from river_edge.measure.files import DERIVED, prepare_files

    mine = river_copy.parent / "tiny.backbone.gguf"
    shutil.copy(tiny_llama_base, mine)
    before = mine.read_bytes()
    r = runner.invoke(app, ["bench", str(river_copy), "--quick", "--mode", "q4_0", "-o", str(tmp_path / "out")])
    assert r.exit_code == 1 and "a file river-edge did not write" in r.stderr and "Traceback" not in r.output
    assert mine.read_bytes() == before
    mine.unlink()
    files, _ = prepare_files(river_copy, plain=("q4_0",))
    assert all(value(open_gguf(files[k]), DERIVED) for k in ("plain-f16", "q4_0"))
    t = files["q4_0"].stat().st_mtime_ns
    assert prepare_files(river_copy, plain=("q4_0",))[0]["q4_0"].stat().st_mtime_ns == t   # reused


def test_the_backbones_size_is_known_without_its_file(river_copy):
    """The first screen's *File MiB* of a backbone row: the backbone's own file size, also where no plain backbone
    file was written (a run of exact and backbone alone); the plain file is larger only by the river's keys' absence."""
    from river_edge.measure.files import prepare_files

    _, notes = prepare_files(river_copy, plain=())
    assert "plain-f16" not in notes["file_bytes"]
    files, _ = prepare_files(river_copy, plain=(), backbone=True)
    assert abs(notes["backbone_bytes"] - files["plain-f16"].stat().st_size) < 4096   # header and keys only


def test_the_output_folder_is_checked_before_measuring(river_copy, runner, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    measured = []
    monkeypatch.setattr(B, "run_bench", lambda *a, **k: measured.append(1))
    r = runner.invoke(app, ["bench", str(river_copy), "--quick", "-o", str(tmp_path / "afile" / "sub")])
    assert r.exit_code == 1 and "cannot make the output folder" in r.stderr and not measured
