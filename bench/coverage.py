"""How much of a model's greedy text a trimmed LM head holds, per size (issue 42: what head drafting's acceptance can
be). For each workload of bench/head.py (16 chat, 16 edit prompts), the stock runtime's greedy answer (n tokens), and
for each trimmed-head size n the share of answer tokens among the rows head drafting would have set at that point:
the ranking's first n (headrank.py), the request's prompt, and the tokens missed earlier in the workload (they join
the rows after every 16, as headdraft.TrimmedHead does). A drafted token is accepted exactly when it is held, so this
is the acceptance a size would have, before any cost. Writes bench/results/hosts/<host>/coverage_<model>.json.

    .venv/bin/python -m bench.coverage gemma3-270m smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import llama_cpp
import numpy as np

from bench.head import CHAT, edit_prompts
from river_edge import zoo
from river_edge.host import host
from bench.recorded import host_folder
from river_edge.runtime.headdraft import MISSES
from river_edge.runtime.headrank import chat_tokens, load_or_build
from river_edge.runtime.llama import RiverLlama

_HERE = Path(__file__).resolve().parent


def answer(llm, prompt: list[int], n: int) -> list[int]:
    """The greedy answer, n tokens or to its end (the stock runtime and every mode alike: bench/stocktext.py too)."""
    out = []
    for tok in llm.generate(prompt, temp=0.0, reset=True):
        out.append(int(tok))
        if len(out) >= n or llama_cpp.llama_vocab_is_eog(llm._model.vocab, int(tok)):
            break
    return out


def coverage(ranking: np.ndarray, prompts: list[list[int]], answers: list[list[int]], sizes) -> dict:
    place = np.empty(len(ranking), dtype=np.int64)
    place[ranking] = np.arange(len(ranking))
    out = {}
    for n in sizes:
        missed, joined, held, total = [], set(), 0, 0
        for p, a in zip(prompts, answers):
            always = set(p) | joined
            for t in a:
                total += 1
                if place[t] < n or t in always:
                    held += 1
                elif t not in missed:
                    missed.append(t)
                    if len(missed) % MISSES == 0:
                        joined |= set(missed)
                        always |= set(missed)
        out[int(n)] = round(held / total, 4)
    return out


def measure_coverage(name: str, n_tokens: int, threads: int) -> dict:
    path = str(zoo.prepare(name))
    llm = RiverLlama(path, n_ctx=2048, seed=0, n_threads=threads, n_threads_batch=threads)
    ranking = load_or_build(llm)
    stock = llama_cpp.Llama(path, n_ctx=2048, seed=0, n_threads=threads, n_threads_batch=threads, verbose=False)
    nv = llm.decoder.n_vocab
    sizes = sorted({min(nv, s) for s in (2048, 4096, nv // 32, nv // 16, nv // 8, nv // 4, nv // 2) if s >= 1024})
    res = {"model": name, "file": Path(path).name, "host": host(threads), "n_vocab": nv, "n_tokens": n_tokens,
           "note": "greedy answers of the stock runtime on the shipped file; coverage = acceptance head drafting would "
                   "have at each trimmed-head size"}
    for work, texts in (("chat", CHAT), ("edit", edit_prompts())):
        prompts = [chat_tokens(llm, t) for t in texts]
        answers = [answer(stock, p, n_tokens) for p in prompts]
        res[work] = {"tokens": sum(map(len, answers)), "coverage_by_rows": coverage(ranking, prompts, answers, sizes)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", choices=list(zoo.MODELS))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for name in a.models:
        res = measure_coverage(name, a.tokens, a.threads)
        folder = host_folder(_HERE / "results", res["host"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"coverage_{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({k: res[k] for k in ("model", "chat", "edit")}))


if __name__ == "__main__":
    main()
