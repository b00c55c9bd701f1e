"""Every measurement behind docs/results.md, and that page's generated section.

    .venv/bin/python -m bench.steps run       # all steps not yet done (resumable), then the report
    .venv/bin/python -m bench.steps run --limit 3 --out /tmp/smoke   # a smoke run: tiny sizes, minutes
    .venv/bin/python -m bench.steps report    # only regenerate docs/results.md + plots from bench/results/*.json
    .venv/bin/python -m bench.steps rescore   # GSM8K/MATH summaries re-read from their stored answers, then report

`make results` runs the first. Each step writes one JSON into bench/results/ and is skipped when that file
exists (`--redo STEP` runs it again); speed steps go to this machine's folder instead when bench/results/ holds
another host's (bench/results/hosts/NAME/, bench.recorded.host_folder); the accuracy evaluation also resumes per problem (JSONL in
bench/results/eval/). The report writes bench/results/pareto_*.png, depth_*.png and the generated section of docs/results.md
between the `results:begin` / `results:end` markers, from the JSON alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from river_edge.gguf_tools.writer import write_text
from bench.device_bench import device_section
from bench.recorded import GEMMA, PLAIN_CONFIGS, QWEN, QWEN15, SMOL
from bench.report import EVAL_CONFIGS, FULL, results_report

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
_RESULTS = _HERE / "results"
MEASURED_MODES = "exact,exact:ngram,exact:ngram-cache,exact:river+ngram,gated,river,fast,backbone," + PLAIN_CONFIGS
# the 1.5B: exact mode only (no thresholds needed), each drafter, over the F16 upcast and over the shipped file
CONFIGS_15 = "exact,exact:ngram,exact:ngram-cache,exact:river+ngram,exact:draft,backbone," + PLAIN_CONFIGS
# exact mode over quantized backbones, flash attention on for every configuration: with it a verification row has
# the bits of a one-token decode on CPU, so batches are exact over quantized weights too (docs/design.md, section 4)
# (the backbone row is those weights decoded one token at a time)
CONFIGS_QUANT = "exact,backbone,shipped"
# Gemma 3 270M: exact mode, the paper's rule and the lagged rule against the files a user would run instead
CONFIGS_GEMMA = "exact,exact:river+ngram,river,river:lagged,backbone," + PLAIN_CONFIGS
LONG_PROMPT = "Write a detailed, well-structured essay on the history of computing, from the abacus to modern GPUs."
BATCH_PROMPTS = ["Explain how a bicycle works, step by step.", "Write a Python function that merges two sorted lists.",
                 "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?", "Describe the water cycle."]


def _river(model: str) -> Path:
    from river_edge.defaults import default_river
    return default_river(model=model)


def _say(what, done, total):
    print(f"  {what} {done}/{total}", end="\r", flush=True)


# -- steps -------------------------------------------------------------------------------------------------

def step_calibration(out: Path, limit: int | None, model: str) -> dict:
    src = Path(f"{_river(model)}.calibration.json")
    return json.loads(src.read_text())


def _exact_river(model: str, backbone: str = "f16") -> Path:
    """A river GGUF for exact mode alone (thresholds +inf: exact mode drafts on the river, never exits); backbone
    f16 (the default river GGUF), keep (the shipped file's own tensors) or q8_0, the river q4_0 in each."""
    from river_edge import zoo
    from river_edge.defaults import build_calibrated_river, default_river_path
    path = default_river_path(model)
    if backbone != "f16":
        path = path.with_name(f"{model}.{backbone}.river.gguf")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)   # the cache's folder: a fresh machine has none yet
        build_calibrated_river(zoo.prepare(model), path, target=None, progress=_say, backbone=backbone)
    return path


def step_modes(out: Path, limit: int | None, model: str, modes: str = MEASURED_MODES, backbone: str | None = None,
               max_rounds: int | None = None, flash_attn: bool = False) -> dict:
    from river_edge.measure import modes as M
    kw = dict(tokens=12, rounds=1, max_rounds=1, n_prompts=1) if limit else \
        dict(max_rounds=max_rounds) if max_rounds else {}
    path = _exact_river(model, backbone) if backbone else _river(model)
    return M.run_modes(path, M.parse_modes(modes), progress=_say, flash_attn=flash_attn, **kw)


# the same-text counts of the modes tables: greedy runs are deterministic, so distinct prompts say more than rounds
TEXT_PROMPTS = 16


def step_text(out: Path, limit: int | None, model: str, modes: str = MEASURED_MODES, backbone: str | None = None,
              max_rounds: int | None = None, flash_attn: bool = False) -> dict:
    """A modes step's configurations, each once over TEXT_PROMPTS distinct chat prompts (the timed runs' four
    among them), untimed: identical runs / runs for its table (records.load_modes)."""
    from river_edge.measure import modes as M
    path = _exact_river(model, backbone) if backbone else _river(model)
    res = M.run_modes(path, M.parse_modes(modes), tokens=12 if limit else 64, n_prompts=2 if limit else TEXT_PROMPTS,
                rounds=1, max_rounds=1, memory=False, flash_attn=flash_attn, progress=_say)
    res["kind"] = "text"
    res["timing"] = "untimed: the tok/s here come from a pass that may share the machine; read only the counts"
    return res


def step_upcast(out: Path, limit: int | None, model: str) -> dict:
    from river_edge import zoo
    from bench import upcast
    return upcast.measure_upcast(zoo.prepare(model), progress=_say)


def step_runtime(out: Path, limit: int | None, model: str) -> dict:
    from river_edge.measure import bench as B
    kw = dict(B.QUICK_BENCH) if limit else {}
    return B.run_bench(_river(model), progress=_say, **kw)


def step_quality(out: Path, limit: int | None, model: str) -> dict:
    from bench import quality as Q
    kw = dict(n_texts=2, max_tokens=24) if limit else dict(n_texts=8, max_tokens=160)
    return Q.measure_quality(_river(model), list(Q.DEFAULT_CONFIGS) + ["taus", "gates"], progress=_say, **kw)


EVAL_LIMIT: int | None = None   # --eval-limit: fewer problems per task, everything else full size


def step_eval(out: Path, limit: int | None, model: str, task: str) -> dict:
    from river_edge.measure import evaluate as E
    n = limit or min(FULL[task], EVAL_LIMIT or FULL[task])
    return E.run_eval(_river(model), task, limit=n, configs=EVAL_CONFIGS, threads=2,
                 results=out / "eval" / f"{model}.{task}.jsonl", progress=_say)


def step_long(out: Path, limit: int | None, model: str) -> dict:
    from bench import figures, longrun as LR
    path = _river(model)
    n_long, n_batch = (24, 12) if limit else (2048, 256)
    res = {"long": LR.kl_along_sequence(path, ("river", "fast"), prompt=LONG_PROMPT, n_tokens=n_long, progress=_say),
           "batch": LR.kl_in_batch(path, BATCH_PROMPTS, n_tokens=n_batch, progress=_say)}
    figures.longrun(res["long"], res["batch"], out / f"longrun_{model}.png")
    return res


def step_spec_compare(out: Path, limit: int | None, model: str) -> dict:
    from river_edge import zoo
    path = _exact_river(QWEN15)
    draft = zoo.prepare(QWEN)
    args = ["--river", str(path), "--draft", str(draft), "--name", QWEN15, "--out", str(out)]
    args += ["--rounds", "1", "--tokens", "12"] if limit else ["--rounds", "8"]
    subprocess.run([sys.executable, "-m", "bench.spec_compare", *args], check=True, cwd=_ROOT)
    return json.loads((out / f"spec_compare_{QWEN15}.json").read_text())


STEPS = {
    f"calibration_{SMOL}": (step_calibration, dict(model=SMOL)),
    f"calibration_{QWEN}": (step_calibration, dict(model=QWEN)),
    **{f"upcast_{m}": (step_upcast, dict(model=m)) for m in (SMOL, QWEN, QWEN15)},
    f"modes_{SMOL}": (step_modes, dict(model=SMOL, max_rounds=6)),
    f"modes_{QWEN}": (step_modes, dict(model=QWEN, max_rounds=4)),
    f"calibration_{GEMMA}": (step_calibration, dict(model=GEMMA)),
    f"modes_{GEMMA}": (step_modes, dict(model=GEMMA, modes=CONFIGS_GEMMA, max_rounds=4)),
    # the 1.5B's rounds capped: about 5 minutes each on 2 cores
    f"modes_{QWEN15}": (step_modes, dict(model=QWEN15, modes=CONFIGS_15, backbone="f16", max_rounds=5)),
    f"modes_{QWEN15}-keep": (step_modes, dict(model=QWEN15, modes=CONFIGS_QUANT, backbone="keep", max_rounds=4,
                                              flash_attn=True)),
    f"modes_{QWEN15}-q8_0": (step_modes, dict(model=QWEN15, modes=CONFIGS_QUANT, backbone="q8_0", max_rounds=4,
                                              flash_attn=True)),
    f"modes_{QWEN}-q8_0": (step_modes, dict(model=QWEN, modes=CONFIGS_QUANT, backbone="q8_0", max_rounds=4, flash_attn=True)),
    f"quality_{SMOL}": (step_quality, dict(model=SMOL)),
    f"quality_{QWEN}": (step_quality, dict(model=QWEN)),
    f"runtime_{SMOL}": (step_runtime, dict(model=SMOL)),
    f"runtime_{QWEN}": (step_runtime, dict(model=QWEN)),
    f"longrun_{SMOL}": (step_long, dict(model=SMOL)),
    f"spec_compare_{QWEN15}": (step_spec_compare, dict(model=QWEN15)),
    **{f"eval_{QWEN}_{t}": (step_eval, dict(model=QWEN, task=t)) for t in FULL},
}


def step_text_spec_compare(out: Path, limit: int | None, model: str) -> dict:
    from river_edge import zoo
    args = ["--river", str(_exact_river(QWEN15)), "--draft", str(zoo.prepare(QWEN)), "--name", QWEN15, "--out", str(out),
            "--text-prompts", "2" if limit else str(TEXT_PROMPTS), "--tokens", "12" if limit else "64"]
    subprocess.run([sys.executable, "-m", "bench.spec_compare", *args], check=True, cwd=_ROOT)
    return json.loads((out / f"text_spec_compare_{QWEN15}.json").read_text())


STEPS.update({f"text_{n.removeprefix('modes_')}": (step_text, kw) for n, (_, kw) in list(STEPS.items())
              if n.startswith("modes_")})
STEPS[f"text_spec_compare_{QWEN15}"] = (step_text_spec_compare, dict(model=QWEN15))


# speeds belong to one machine: these steps go to this host's folder (bench.recorded.host_folder); the rest (accuracy,
# calibration) are kept once, in the results folder itself, by choice (their host is named in them where recorded)
SPEED = ("modes_", "runtime_", "spec_compare_", "text_")


def run_steps(out: Path, limit: int | None, only: list[str] | None, redo: list[str], as_host: Path | None = None) -> None:
    from river_edge.host import host
    from bench.recorded import host_folder, machine, recorded_machine

    here = host()
    speeds = as_host.resolve() if as_host else host_folder(out, here)   # resolved: its paths print relative to out
    for folder in (out, speeds):
        folder.mkdir(parents=True, exist_ok=True)
    if speeds != out:
        print(f"speed steps: {speeds} (this machine, {here['cpu']['model']}; {out} holds another host's)")
    for name, (fn, kw) in STEPS.items():
        if only and name not in only or as_host and not (name.startswith("text_") and
                                                         (as_host / f"{timed_table(name)}.json").is_file()):
            continue   # --as-host: only the text passes of the tables that host has
        folder = speeds if name.startswith(SPEED) else out
        dst = folder / f"{name}.json"
        if dst.is_file() and name not in redo:
            other = recorded_machine(dst) if name.startswith(SPEED) and not as_host else None
            if other in (None, machine(here)):
                print(f"{name}: done ({dst.relative_to(out)})")
                continue
            print(f"{name}: {dst} was measured on {other[0]}: measuring it here")
        print(f"{name}: running", flush=True)
        t0 = time.time()
        res = fn(folder, limit, **kw)
        if as_host:
            res["as_host"] = _host_of(as_host)[0]
        if isinstance(res, dict):
            res.setdefault("step_seconds", time.time() - t0)
            res.setdefault("load_average_end", os.getloadavg())
        write_text(dst, json.dumps(res, indent=1) + "\n")
        print(f"\n{name}: {time.time() - t0:.0f} s")


def timed_table(text_step: str) -> str:
    """The timed table a text step counts the same text for: text_KEY -> modes_KEY, text_spec_compare_M ->
    spec_compare_M."""
    rest = text_step.removeprefix("text_")
    return rest if rest.startswith("spec_compare_") else f"modes_{rest}"


def _host_of(folder: Path) -> tuple[str, str]:
    """Another host's folder: its CPU in a few words and the ggml CPU variant its modes runs loaded."""
    from bench.recorded import cpu_words
    ms = [json.loads(p.read_text()) for p in sorted(folder.glob("modes_*.json"))]
    variants = {((m.get("host") or {}).get("runtime") or {}).get("cpu_variant") for m in ms}
    if len(variants) != 1 or None in variants:
        raise SystemExit(f"{folder}: its modes runs name no single ggml CPU variant ({variants or 'no runs'})")
    return cpu_words(ms[0]), variants.pop()


def as_host_env(folder: Path) -> None:
    """--as-host: re-run this process with that host's CPU variant forced (GGML_CPU_VARIANT, read when the runtime
    loads), and refuse where this CPU cannot execute it or the runtime loaded another."""
    name, variant = _host_of(folder)
    if os.environ.get("GGML_CPU_VARIANT") != variant:
        os.execve(sys.executable, [sys.executable, "-m", "bench.steps", *sys.argv[1:]],
                  dict(os.environ, GGML_CPU_VARIANT=variant))
    from river_edge.host import cpu_variant, devices
    devices()   # loads ggml's backends, the CPU variant among them
    if cpu_variant() != variant:
        raise SystemExit(f"{folder}: {name} loaded ggml's {variant} variant; here the runtime loaded {cpu_variant()} "
                         "(this CPU cannot execute it, or the runtime has no such variant)")


def rescore_evals(out: Path) -> None:
    """Each eval_<model>_<task>.json re-scored from its rows in eval/ by today's answer extraction (no decoding)."""
    from river_edge.measure import evaluate as E

    for p in sorted(out.glob("eval_*.json")):
        model, task = p.stem.removeprefix("eval_").rsplit("_", 1)
        rows = E.read_results(out / "eval" / f"{model}.{task}.jsonl")
        d = E.rescore(json.loads(p.read_text()), rows)
        if task != "humaneval":
            d["rescored"] = "answers re-read from the stored completions by today's extraction (python -m bench.steps rescore)"
        write_text(p, json.dumps(d, indent=1) + "\n")
        print(f"{p.name}: " + ", ".join(f"{c} {x['correct']}/{x['n']}" for c, x in d["configs"].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("run", "report", "rescore"))
    ap.add_argument("--out", type=Path, default=_RESULTS, help="folder of the JSON and plots")
    ap.add_argument("--limit", type=int, help="smoke run: N problems per task and tiny sizes everywhere")
    ap.add_argument("--eval-limit", type=int, help="at most N problems per accuracy task (the rest full size)")
    ap.add_argument("--only", help="comma list of steps (" + ", ".join(STEPS) + ")")
    ap.add_argument("--redo", default="", help="comma list of steps to run again")
    ap.add_argument("--readme", type=Path, default=None, help="page whose marked section is rewritten (default: docs/results.md, "
                    "only when --out is bench/results)")
    ap.add_argument("--as-host", type=Path, help="another host's folder (bench/results/hosts/NAME): run its text steps "
                    "here with the ggml CPU variant that host loaded, into that folder")
    a = ap.parse_args(argv)
    if a.as_host:
        as_host_env(a.as_host)
    global EVAL_LIMIT
    EVAL_LIMIT = a.eval_limit
    page = _ROOT / "docs" / "results.md"
    readme = a.readme or (page if a.out.resolve() == _RESULTS.resolve() else None)
    if a.what == "run":
        run_steps(a.out, a.limit, a.only.split(",") if a.only else None, [x for x in a.redo.split(",") if x], a.as_host)
        if a.out.resolve() == _RESULTS.resolve():
            from bench import builds
            builds.main()   # the new records' builds, matched to their series before the pages name them
    if a.what == "rescore":
        rescore_evals(a.out)
    front = _ROOT / "README.md" if readme is not None and readme.resolve() == page.resolve() else None
    print(results_report(a.out, readme, front, extra=device_section))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
