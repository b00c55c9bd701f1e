"""The results pages' logic (bench/report.py): which river configurations plain quantization
dominates, and the README section written between its markers from the JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import headline as H, report as R


def cfg(speed, kl, agree=0.9, **kw):
    return dict(speed_ratio=speed, kl=kl, agreement=agree, perplexity=10.0, decode_tok_s=speed * 10, **kw)


def quality(shipped=None):
    return {"model": "m", "n_layer": 4, "texts": ["gsm8k"], "positions": 10, "shipped_type": shipped,
            "configs": {"backbone": cfg(1.0, 0.0, 1.0, mean_depth=4.0), "q4_1": cfg(3.0, 0.001),
                        "q8_0": cfg(1.4, 0.002), "river": cfg(1.3, 0.05, mean_depth=2.0, hist=[0, 0, 5, 0, 5]),
                        "fast": cfg(2.0, 0.2, mean_depth=0.0)}}


def test_dominance_names_the_plain_type_that_is_faster_and_closer():
    lines = R._dominance(quality())
    river = next(x for x in lines if "**river**" in x)
    assert "dominated by plain Q4_1" in river  # Q8_0 and Q4_1 both beat it; the closer one is named
    assert "dominated by plain Q4_1" in next(x for x in lines if "**fast**" in x)
    lines = R._dominance(dict(quality(), configs={**quality()["configs"], "q4_1": cfg(3.0, 0.06)}))
    assert "dominated by plain Q8_0" in next(x for x in lines if "**river**" in x)


def test_the_shipped_type_is_not_a_fair_point():
    lines = R._dominance(quality(shipped="q4_1"))
    assert "not dominated" in next(x for x in lines if "**fast**" in x)  # only Q4_1 beat it
    assert "shipped type" in "\n".join(R._quality(quality(shipped="q4_1"), None))


def test_report_rewrites_only_the_marked_section(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / f"quality_{R.SMOL}.json").write_text(json.dumps(quality()))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n{R.BEGIN}\nold\n{R.END}\n\n## Tests\nkept\n")
    text = R.results_report(out, readme)
    body = readme.read_text()
    assert "old" not in body and body.endswith(f"{R.END}\n\n## Tests\nkept\n") and text in body
    assert "| river | 0.0500 | 0.900 |" in body
    assert "](results/pareto_" in body and "](bench/results/" not in body   # plots linked from the page's folder
    assert (out / f"pareto_{R.SMOL}.png").stat().st_size > 1000 and (out / f"depth_{R.SMOL}.png").is_file()
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="no results markers"):
        R.results_report(out, readme)


def _modes(cpu, configs):
    rows = [{"tok_s": {c: v * f for c, v in configs.items()}} for f in (1.0, 1.1)]
    conf = {c: {"tok_s_median": v, "ratio_median": v / configs["backbone"], "ratio_min": 0, "ratio_max": 9,
                "ratio_ci95": [v / configs["backbone"] - 0.1, v / configs["backbone"] + 0.1], "identical_runs": 2,
                "runs": 2, "file_mib": 100.0, "memory": {"peak_mib": 200.0}, "common_prefix_mean": 8.0}
            for c, v in configs.items()}
    return {"model": "m", "threads": 2, "load_before": {"loadavg_1_5_15": [0.5, 0, 0]}, "rows": rows, "configs": conf,
            "host": {"cpu": {"model": cpu, "isa": ["avx2", "amx_tile", "sse4_2"]}}}


def test_headline_one_table_per_host_with_the_shipped_file_beside(tmp_path):
    (tmp_path / f"modes_{R.SMOL}.json").write_text(json.dumps(_modes("Xeon", {"backbone": 10.0, "exact": 12.0,
                                                                                 "exact:ngram": 11.0, "shipped": 30.0})))
    (tmp_path / f"modes_{R.QWEN15}.json").write_text(json.dumps(_modes("EPYC", {"backbone": 5.0, "shipped": 10.0})))
    lines = H.headline(tmp_path)
    assert sum(x.startswith("| model |") for x in lines) == 2              # two hosts, two tables
    assert "*host Xeon (avx2, amx_tile), 2 threads:*" in lines and "*host EPYC (avx2, amx_tile), 2 threads:*" in lines
    exact = next(x for x in lines if x.startswith(f"| {R.SMOL} | exact |"))
    assert "| 1.20x (1.10-1.30) | 0.40x | - | 2/2 | 100 | 200 |" in exact   # x backbone, shipped, Q8_0, same, MiB, peak
    assert not any("exact:ngram" in x for x in lines)                      # the first screen keeps the main rows


def test_runs_from_another_host_get_their_own_tables(tmp_path):
    """bench/results/hosts/NAME/ holds another host's runs: the headline gives them a table of their own and the
    results page a section at its end, plots beside their JSON."""
    (tmp_path / f"modes_{R.QWEN15}.json").write_text(json.dumps(dict(_modes("Xeon", {"backbone": 5.0, "q8_0": 10.0}),
                                                                     tokens=8, prompts=["p"], rounds=2)))
    other = tmp_path / "hosts" / "zen4"
    other.mkdir(parents=True)
    (other / f"modes_{R.QWEN15}.json").write_text(json.dumps(dict(_modes("EPYC", {"backbone": 6.0, "q8_0": 7.2}),
                                                                  tokens=8, prompts=["p"], rounds=2)))
    lines = H.headline(tmp_path)
    assert sum(x.startswith("| model |") for x in lines) == 2
    epyc = lines[lines.index("*host EPYC (avx2, amx_tile), 2 threads:*"):]
    assert next(x for x in epyc if x.startswith(f"| {R.QWEN15} | q8_0 |")).startswith(f"| {R.QWEN15} | q8_0 | 7.2 | 1.20x")
    assert next(x for x in epyc if x.startswith(f"| {R.QWEN15} | backbone")).split(" | ")[5] == f"{6.0 / 7.2:.2f}x"  # x Q8_0
    text = R.results_report(tmp_path, None)
    assert text.index("Other hosts: zen4") > text.index("host Xeon") and "host EPYC" in text.split("Other hosts")[1]
    assert (other / f"modes_{R.QWEN15}.png").is_file()


def test_speed_steps_go_to_the_folder_of_the_host_they_run_on(tmp_path):
    """`make results` on another machine neither skips speed steps another host did nor writes into its tables:
    bench/results/ when its modes JSONs are this machine's (or it has none), else the hosts/ folder whose are,
    else a new one named after the CPU and ggml's variant."""
    from bench.recorded import host_folder

    here = {"cpu": {"model": "AMD EPYC", "isa": ["avx2", "avx512f"], "cpus": 2}, "runtime": {"cpu_variant": "zen4"}}
    assert host_folder(tmp_path, here) == tmp_path                                   # nothing measured yet
    xeon = _modes("Intel(R) Xeon(R) Processor", {"backbone": 5.0})
    (tmp_path / f"modes_{R.SMOL}.json").write_text(json.dumps(xeon))
    assert host_folder(tmp_path, here) == tmp_path / "hosts" / "amd-epyc-zen4"       # new folder, named after the CPU
    mine = tmp_path / "hosts" / "zen4-box"
    mine.mkdir(parents=True)
    (mine / f"modes_{R.SMOL}.json").write_text(json.dumps(dict(xeon, host={"cpu": here["cpu"]})))
    assert host_folder(tmp_path, here) == mine                                       # the folder of this machine's runs
    fewer = dict(here, cpu=dict(here["cpu"], cpus=4))                                # same CPU, other core count
    assert host_folder(tmp_path, fewer) == tmp_path / "hosts" / "amd-epyc-zen4"
    assert host_folder(tmp_path, {"cpu": xeon["host"]["cpu"]}) == tmp_path           # the Xeon's own runs
    mine.rename(tmp_path / "hosts" / "amd-epyc-zen4")                                # its name taken by another machine
    (tmp_path / "hosts" / "amd-epyc-zen4" / "modes_odd.json").write_text("[1, 2")    # a cut JSON is no host record
    assert host_folder(tmp_path, fewer) == tmp_path / "hosts" / "amd-epyc-zen4-4c"
    assert host_folder(tmp_path, here) == tmp_path / "hosts" / "amd-epyc-zen4"


def test_make_results_routes_speed_steps_to_this_machines_folder(tmp_path, monkeypatch):
    """bench/steps.py run: a speed step goes to this machine's folder and is measured there even though the
    results folder holds another host's; an accuracy step stays in the results folder; a speed JSON another
    machine left in this machine's folder is measured again, one of this machine is not."""
    import importlib.util

    from river_edge import host as H_

    spec = importlib.util.spec_from_file_location("steps_script", R.__file__.replace("report.py", "steps.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    here = {"cpu": {"model": "AMD EPYC", "isa": ["avx2"], "cpus": 2}, "runtime": {"cpu_variant": "zen4"}}
    monkeypatch.setattr(H_, "host", lambda threads=None: here)
    ran = []

    def step(folder, limit, name):
        ran.append((name, folder))
        return {"host": here} if name.startswith("modes") else {}
    monkeypatch.setattr(script, "STEPS", {n: (step, dict(name=n)) for n in ("modes_a", "modes_b", "quality_a")})
    xeon = {"host": {"cpu": {"model": "Xeon", "isa": ["amx_tile"], "cpus": 2}}}
    (tmp_path / "modes_a.json").write_text(json.dumps(xeon))
    mine = tmp_path / "hosts" / "amd-epyc-zen4"
    mine.mkdir(parents=True)
    (mine / "modes_a.json").write_text(json.dumps({"host": here}))
    (mine / "modes_b.json").write_text(json.dumps(xeon))                             # left by another machine
    script.run_steps(tmp_path, None, None, [])
    assert ran == [("modes_b", mine), ("quality_a", tmp_path)]
    assert json.loads((mine / "modes_b.json").read_text())["host"] == here and (tmp_path / "quality_a.json").is_file()
    assert json.loads((tmp_path / "modes_a.json").read_text()) == xeon                # the other host's, untouched


def test_same_text_counts_come_from_the_sixteen_prompt_pass(tmp_path):
    """A modes table's *same text* column: the counts of text_<key>.json (each configuration once over 16 distinct
    prompts) where that pass was made, with a line saying where; the timed runs' own counts otherwise."""
    m = dict(_modes("Xeon", {"backbone": 10.0, "exact": 12.0, "q8_0": 20.0}), tokens=64, prompts=["p"] * 4, rounds=3)
    (tmp_path / f"modes_{R.SMOL}.json").write_text(json.dumps(m))
    text = R.results_report(tmp_path, None)
    assert "| exact | 12.0 |" in text and "| 2/2 |" in text and "the timed runs (4 prompts x 3 rounds)" in text
    t = {"prompts": ["p"] * 16, "tokens": 64, "as_host": "AMD EPYC (avx2, avx512f)",
         "host": {"cpu": {"model": "Xeon", "isa": ["amx_tile"]}, "runtime": {"cpu_variant": "zen4"}},
         "configs": {"backbone": {"identical_runs": 16, "runs": 16}, "exact": {"identical_runs": 16, "runs": 16},
                     "q8_0": {"identical_runs": 5, "runs": 16}}}
    (tmp_path / f"text_{R.SMOL}.json").write_text(json.dumps(t))
    text = R.results_report(tmp_path, None)
    q8 = next(x for x in text.splitlines() if x.startswith("| q8_0 | 20.0 |"))
    assert "| 5/16 |" in q8 and "| 2/2 |" not in text
    assert ("every configuration once over 16 distinct chat prompts, 64 greedy tokens each" in text
            and "ggml's zen4 variant, the variant AMD EPYC (avx2, avx512f) loads" in text)
    lines = H.headline(tmp_path)
    assert "| 5/16 |" in next(x for x in lines if x.startswith(f"| {R.SMOL} | q8_0 |"))
    assert "each configuration run once on each of 16 distinct chat prompts" in lines[0]
    del t["configs"]["q8_0"]                                    # a pass that missed a configuration is refused
    (tmp_path / f"text_{R.SMOL}.json").write_text(json.dumps(t))
    with pytest.raises(Exception, match="no same-text count for q8_0"):
        R.results_report(tmp_path, None)


def test_as_host_runs_only_the_text_steps_into_that_hosts_folder(tmp_path, monkeypatch):
    """--as-host hosts/NAME: the same-text pass of another host's tables, run here under the CPU variant that host
    loaded, written into its folder and saying so; no speed step runs, nor the pass of a table it lacks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("steps_script", R.__file__.replace("report.py", "steps.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ran = []

    def step(folder, limit, name):
        ran.append((name, folder))
        return {}
    monkeypatch.setattr(script, "STEPS", {n: (step, dict(name=n))   # text_b: a table that host does not have
                                          for n in ("modes_a", "text_a", "text_b", "quality_a")})
    amd = tmp_path / "hosts" / "zen4"
    amd.mkdir(parents=True)
    rec = {"host": {"cpu": {"model": "AMD EPYC", "isa": ["avx2", "avx512f"], "cpus": 2},
                    "runtime": {"cpu_variant": "zen4"}},
           "threads": 2}
    (amd / "modes_a.json").write_text(json.dumps(rec))
    assert script._host_of(amd) == ("AMD EPYC (avx2, avx512f)", "zen4")
    assert script.timed_table("text_a") == "modes_a" and script.timed_table("text_spec_compare_m") == "spec_compare_m"
    script.run_steps(tmp_path, None, None, [], as_host=amd)
    assert ran == [("text_a", amd)] and json.loads((amd / "text_a.json").read_text())["as_host"] == "AMD EPYC (avx2, avx512f)"
    monkeypatch.chdir(tmp_path)   # resumed with the folder named relative to here: the done step is skipped
    script.run_steps(tmp_path, None, None, [], as_host=Path("hosts/zen4"))
    assert ran == [("text_a", amd)]
    (amd / "modes_b.json").write_text(json.dumps(dict(rec, host={"cpu": {"model": "AMD EPYC"}})))  # no variant named
    with pytest.raises(SystemExit, match="no single ggml CPU variant"):
        script._host_of(amd)


def test_a_host_folder_shows_its_spec_compare_and_runtime_host(tmp_path):
    """spec_compare records its load as os.getloadavg() (a list) and the runtime benchmark under host: a host
    folder's sections name both (the report crashed on the list)."""
    from bench.recorded import host_line

    host = {"cpu": {"model": "EPYC", "isa": ["avx2"]}, "threads": 2, "loadavg_1_5_15": [0.75, 0, 0]}
    assert host_line({"host": host, "load_before": [1.234, 1.0, 1.0], "threads": 2}) == "host EPYC (avx2), 2 threads, load 1.23"
    assert host_line({"host": host}) == "host EPYC (avx2), 2 threads, load 0.75"
    other = tmp_path / "hosts" / "zen4"
    other.mkdir(parents=True)
    (other / f"spec_compare_{R.QWEN15}.json").write_text(json.dumps({
        "model": R.QWEN15, "tokens": 8, "rounds": 2, "host": host, "load_before": [1.5, 1, 1],
        "ratio_median": {"backbone": 1.0, "exact": 1.4}, "tok_s_median": {"backbone": 10.0, "exact": 14.0},
        "identical_rounds": {"backbone": 2, "exact": 2}, "peak_mib": {}, "file_mib": {"backbone": 1, "river": 2, "draft": 1}}))
    runtime = json.loads((Path(R.__file__).parent / "results" / "hosts" / "amd-epyc-zen4" /
                          f"runtime_{R.SMOL}.json").read_text())   # a real runtime benchmark's JSON
    (other / f"runtime_{R.SMOL}.json").write_text(json.dumps(dict(runtime, host=host)))
    text = R.results_report(tmp_path, None)
    assert "Other hosts: zen4" in text and "host EPYC (avx2), 2 threads, load 1.50" in text.split("Other hosts")[1]
    assert f"Runtime benchmark, {R.SMOL}" in text.split("Other hosts")[1] and (other / f"runtime_{R.SMOL}.png").is_file()


def test_the_ceiling_of_exact_mode_comes_from_its_own_costs():
    """The modes section's ceiling (every draft accepted): the best k over usable batch sizes, against the
    backbone's measured decode step; none where no usable batch can pay."""
    m = {"configs": {"backbone": {"tok_s_median": 50.0},   # a 20 ms step
                     "exact": {"cost_model": {"draft_ms": 10.0, "verify_ms_used": [20.0, 30.0, 35.0],
                                              "usable_batch": [True, True, True]}}}}
    k, ratio, step = R._ceiling(m)
    assert (k, step) == (2, 20.0) and ratio == pytest.approx(20 * 3 / (2 * 10 + 35))
    m["configs"]["exact"]["cost_model"]["usable_batch"] = [True, False, False]
    assert R._ceiling(m)[0] == 0


def test_the_speculation_comparison_counts_same_text_over_its_prompt_pass():
    """spec_compare's table: runs identical to the backbone from text_spec_compare_*.json (each configuration once
    per distinct prompt) where that pass was made, else its timed rounds."""
    s = {"model": R.QWEN15, "tokens": 64, "rounds": 8, "host": {"cpu": {"model": "Xeon"}}, "threads": 2,
         "ratio_median": {"backbone": 1.0, "prompt-lookup:2": 0.8}, "tok_s_median": {"backbone": 10.0, "prompt-lookup:2": 8.0},
         "identical_rounds": {"backbone": 8, "prompt-lookup:2": 8}, "peak_mib": {}, "file_mib": {"backbone": 1, "river": 2, "draft": 1}}
    assert "| prompt-lookup:2 | 8.0 | 0.80 | 8/8 |" in "\n".join(R._spec_compare(s))
    t = {"identical_runs": {"backbone": 16, "prompt-lookup:2": 13}, "runs": 16, "tokens": 64, "threads": 2,
         "host": {"cpu": {"model": "Xeon"}, "runtime": {"cpu_variant": "zen4"}}, "as_host": "AMD EPYC (avx2)"}
    text = "\n".join(R._spec_compare(s, t))
    assert "| config | tok/s | x backbone | runs identical | peak MiB |" in text and "| prompt-lookup:2 | 8.0 | 0.80 | 13/16 |" in text
    assert "once on each of 16 distinct prompts" in text and "the variant AMD EPYC (avx2) loads" in text
    # a pass over other configurations than the timed table's (an older table): the timed rounds, not a mix
    older = {**s, "ratio_median": {**s["ratio_median"], "prompt-lookup": 0.9}, "tok_s_median": {**s["tok_s_median"],
             "prompt-lookup": 9.0}, "identical_rounds": {**s["identical_rounds"], "prompt-lookup": 7}}
    text = "\n".join(R._spec_compare(older, t))
    assert "| prompt-lookup | 9.0 | 0.90 | 7/8 |" in text and "13/16" not in text and "distinct prompts" not in text


ROOT = Path(R.__file__).resolve().parent.parent


def test_committed_pages_are_what_their_json_generates():
    """Drift: the README's headline block and docs/results.md's generated section, regenerated from the committed
    bench/results/**/*.json (and builds.json) exactly as `bench/steps.py report` writes them (plots aside), equal
    the committed text. A figure edited by hand in either block, or a JSON changed without regenerating, fails here."""
    import difflib

    from bench.device_bench import device_section

    page, front = (ROOT / "docs" / "results.md").read_text(), (ROOT / "README.md").read_text()
    new_page, new_front = R.pages(ROOT / "bench" / "results", page, front, "../bench/results", extra=device_section)
    for name, old, new in (("docs/results.md", page, new_page), ("README.md", front, new_front)):
        diff = "".join(list(difflib.unified_diff(old.splitlines(True), new.splitlines(True), name, "regenerated"))[:40])
        assert old == new, f"{name} drifted from its JSON; run `.venv/bin/python -m bench.steps report`:\n{diff}"


def test_every_recorded_build_is_matched_or_said_unmatched():
    """bench/results/builds.json answers for every build a JSON names (a new record needs `bench/builds.py`), and the
    tables' words for a build come from it: its series where matched, never a guess."""
    from bench import builds as B

    doc = json.loads((ROOT / "bench" / "results" / "builds.json").read_text())
    unmatched = B.recorded() - set(doc["builds"]) - set(doc["not_identified"])
    assert not unmatched, f"builds no entry answers for, {sorted(unmatched)}: run `.venv/bin/python -m bench.builds`"
    known = {"a" * 16: {"commit": "c1", "patches": ["0001-x.patch", "0012-y.patch"]},
             "b" * 16: {"commit": "c2", "patches": ["0001-x.patch", B.INVARIANT]}}
    assert B.words("a" * 16, known) == f"build {'a' * 16} (the series of c1: patches 0001-0012, before 0013: batch invariance)"
    assert B.words("b" * 16, known) == f"build {'b' * 16} (the series of c2: patches 0001-0013)"
    assert B.words("c" * 16, known) == f"build {'c' * 16} (series not identified)" and B.words(None, known) == "build not recorded"
    assert B.predates("a" * 16, known) and not B.predates("b" * 16, known) and not B.predates("c" * 16, known)


def test_the_records_the_pages_cite_exist():
    """Every JSON that README.md, docs/ and bench/README.md name as a figure's source is committed (a glob matches at
    least one), so a renamed or dropped record cannot leave a figure citing nothing."""
    import re

    results = ROOT / "bench" / "results"
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]:
        for name in set(re.findall(r"[\w.*/<>-]+\.json\b", page.read_text())):
            if name.startswith("-") or any(x in name for x in ("OUT", "NAME", "<", "...", "device_check")):
                continue   # a suffix of the name before it, or a file a run writes elsewhere
            if "/" in name:   # from the page's folder, the root, or bench/results/ (hosts/NAME/...)
                found = any(any(base.glob(name.removeprefix("../"))) for base in (page.parent, ROOT, results))
            else:
                found = any(results.rglob(name))
            if not found:
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_a_quality_table_takes_its_exact_row_only_from_its_own_host():
    """The distribution table borrows exact mode's row from the modes benchmark: only when both ran on one machine
    (tables never mix hosts), and its header names the borrowed row's build where it differs."""
    q = dict(quality(), host={"cpu": {"model": "Xeon", "isa": ["amx_tile"], "cpus": 2}})
    m = {"configs": {"exact": {"identical_runs": 16, "runs": 16, "ratio_median": 2.0}}}
    here = "\n".join(R._quality(q, dict(m, host=q["host"])))
    assert "exact (from the modes benchmark)" in here
    assert "exact (from the modes benchmark)" not in "\n".join(R._quality(q, dict(m, host={"cpu": {"model": "EPYC"}})))
