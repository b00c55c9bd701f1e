"""Exact and backbone modes against the stock runtime on the same file (issue 41): greedy text only, no timing.

For each model, two files: the shipped GGUF, and (where a river build exists) the river GGUF, whose backbone is the
F16 upcast of the shipped weights; llama_cpp.Llama, the stock runtime, runs that backbone and ignores the river.
On each file the stock runtime's greedy text is the reference, and every mode the file supports is compared with it:
backbone mode, and exact mode with each drafter, once with the cost gate (as a user runs it) and once drafting k = 4
tokens every cycle (so every verification path runs whatever the gate would choose). 16 chat and 16 edit prompts
(bench/head.py's), n tokens each. Writes bench/results/hosts/<host>/stocktext_<model>.json.

    .venv/bin/python -m bench.stocktext smollm2-135m --river ~/.cache/river-edge/rivers/smollm2-135m.river.gguf
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import llama_cpp

from bench import builds as B
from bench.coverage import answer
from bench.head import CHAT, edit_prompts
from river_edge import zoo
from river_edge.host import host
from bench.recorded import host_folder
from river_edge.runtime.headrank import chat_tokens
from river_edge.runtime.llama import RiverLlama

_HERE = Path(__file__).resolve().parent
PLAIN_DRAFTERS = ("ngram", "ngram-cache", "head")     # need no river
RIVER_DRAFTERS = ("river", "river+ngram")             # need the river GGUF


def mode_factories(path: str, river: bool, kw: dict):
    """(name, factory) of every mode the file supports; `name@k4`: drafting four tokens every cycle."""
    yield "backbone", lambda: RiverLlama(path, mode="backbone", **kw)
    for d in PLAIN_DRAFTERS + (RIVER_DRAFTERS if river else ()):
        yield f"exact:{d}", lambda d=d: RiverLlama(path, mode="exact", drafter=d, **kw)
        def forced(d=d):
            llm = RiverLlama(path, mode="exact", drafter=d, **kw)
            llm.decoding.draft_k = 4
            return llm
        yield f"exact:{d}@k4", forced


def check_file(path: str, river: bool, n: int, threads: int, only=None) -> dict:
    kw = dict(n_ctx=2048, seed=0, n_threads=threads, n_threads_batch=threads, verbose=False)
    stock = llama_cpp.Llama(path, **kw)
    work = {"chat": [chat_tokens(stock, t) for t in CHAT], "edit": [chat_tokens(stock, t) for t in edit_prompts()]}
    ref = {w: [answer(stock, p, n) for p in ps] for w, ps in work.items()}
    del stock
    res = {}
    for name, make in mode_factories(path, river, kw):
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        llm = make()
        same = {w: [answer(llm, p, n) == r for p, r in zip(ps, ref[w])] for w, ps in work.items()}
        st = llm.stats()
        res[name] = {w: {"same": sum(s), "of": len(s), "differ": [i for i, x in enumerate(s) if not x]}
                     for w, s in same.items()}
        # drafts verified and accepted: a config that drafted nothing would prove nothing
        res[name].update(drafted=st.get("drafted"), accepted=st.get("accepted"), spec_off=st.get("spec_off"))
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{Path(path).name} {name}: " + ", ".join(f"{w} {v['same']}/{v['of']}" for w, v in res[name].items()
                                                        if isinstance(v, dict)), file=sys.stderr)
        del llm
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=list(zoo.MODELS))
    ap.add_argument("--river", help="the model's river GGUF (its backbone: the F16 upcast of the shipped weights)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="these configurations only, merged into the model's existing record")
    ap.add_argument("--upcast-only", action="store_true", help="the river GGUF alone, merged into the existing record")
    a = ap.parse_args()
    if a.upcast_only and not a.river:
        ap.error("--upcast-only needs --river")
    files = {} if a.upcast_only else {"shipped": (str(zoo.prepare(a.model)), False, None)}
    if a.river:
        files["upcast"] = (a.river, True, "the river GGUF's backbone: the F16 upcast of the shipped weights")
    h = host(a.threads)
    rec = host_folder(_HERE / "results", h) / f"stocktext_{a.model}.json"
    merge = (a.only or a.upcast_only) and rec.exists()
    out = json.loads(rec.read_text()) if merge else \
        {"model": a.model, "tokens": a.tokens, "reference": "llama_cpp.Llama on the same file", "files": {}}
    if merge and out["tokens"] != a.tokens:
        ap.error(f"{rec.name} was measured at {out['tokens']} tokens: give --tokens {out['tokens']}")
    for f in out["files"].values():   # a merge keeps what each file was measured on
        f.setdefault("build", B.build_of(out))
    out["host"] = h
    for key, (path, river, note) in files.items():
        f = out["files"].setdefault(key, {"path": Path(path).name, "modes": {}})
        f["modes"].update(check_file(path, river, a.tokens, a.threads, a.only))
        f["build"] = B.build_of(out)   # (a merge of some configurations: the build of the newest)
        if note:
            f["note"] = note
    rec.parent.mkdir(parents=True, exist_ok=True)
    rec.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
