"""The runtime benchmark on the offline models: bench/results/runtime_<model>.json and .png.

    python bench/runtime_bench.py --model smollm2-135m --model qwen2.5-coder-0.5b

Each model's calibrated river GGUF comes from the cache (built once with the defaults, as `river bench`
does); the plain Q8_0/Q4_0 and backbone files are written once next to it. See river_edge/bench.py for
what is measured and how.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from river_edge import bench as B

# Rounds for about five minutes per model on a 2-core machine (11 configurations x 3 prompts a round).
ROUNDS = {"smollm2-135m": 6, "qwen2.5-coder-0.5b": 3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="zoo model name or river GGUF (repeatable); "
                    "default: smollm2-135m and qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=B.DEFAULT_THREADS)
    ap.add_argument("--tokens", type=int, default=B.DEFAULT_TOKENS, help="greedy decode tokens per prompt")
    ap.add_argument("--rounds", type=int, default=None, help="default: per model, about 5 minutes")
    ap.add_argument("--prompts", type=int, default=B.DEFAULT_PROMPTS, help="packaged prompts per round")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--memory-only", action="store_true",
                    help="re-measure only the peak memory of an existing runtime_<model>.json (and redraw)")
    a = ap.parse_args(argv)

    def say(what, done, total):
        if total <= 0 or done in (0, total):
            print(f"  {what} {done}/{total}" if total > 0 else f"  {what}", file=sys.stderr, flush=True)

    for model in a.model or ["smollm2-135m", "qwen2.5-coder-0.5b"]:
        path = B.resolve_river(model, say)
        if a.memory_only:
            j = a.out / f"runtime_{model}.json"
            res = json.loads(j.read_text())
            files, _ = B.prepare_files(path, say)
            cfgs = B.configs(res["n_layer"])
            from river_edge.tokenizer import Tokenizer

            prompt = Tokenizer(path).chat(res["method"]["prompts"][0])
            mem = B.measure_memory(files, cfgs, res["method"]["n_ctx"], res["method"]["threads"], prompt, say)
            for k, v in mem.items():
                res["configs"][k]["memory"] = v
            res["method"]["memory"] = B.MEMORY_METHOD
            print(B.format_table(res), flush=True)
            print("wrote", *B.write(res, a.out, f"runtime_{res['model']}"), flush=True)
            continue
        res = B.run(path, threads=a.threads, tokens=a.tokens, rounds=a.rounds or ROUNDS.get(model, 3),
                    n_prompts=a.prompts, progress=say)
        print(B.format_table(res), flush=True)
        j, png = B.write(res, a.out, f"runtime_{res['model']}")
        print(f"wrote {j}\nwrote {png}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
