"""River-Spec benchmark: exact mode (and gated, fast) against the backbone, one process, alternating.

    python bench/spec_bench.py --gguf /tmp/spec/qwen2.5-coder-0.5b-river.gguf --name qwen2.5-coder-0.5b

writes bench/results/spec_<name>.json and .png. Every round runs each mode on the same prompt, the order
rotating; ratios are medians over rounds of (mode tok/s) / (backbone tok/s) of the same round. Greedy,
EOS ignored. The cost model (river draft step, backbone verification by batch size) is what the exact mode
measured on this machine, with the speed-up it predicts at the measured acceptance.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from river_edge.runtime import RiverLlama
from river_edge.spec import _COSTS

PROMPTS = [
    "def quicksort(arr):\n    \"\"\"Sort a list of integers in place.\"\"\"\n",
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?\nAnswer: Let's think step by step.",
    "The history of the printing press begins",
    "import numpy as np\n\ndef softmax(x):\n",
]


def gen(llm, prompt, n):
    llm.reset()
    out, t0, t1 = [], None, None
    for tok in llm.generate(prompt, temp=0.0):
        if t0 is None:
            t0 = time.perf_counter()          # the first token comes with the prompt: untimed
        else:
            out.append(tok)
        if len(out) >= n:
            break
    return out, n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="backbone,exact,fast")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    llm = RiverLlama(a.gguf, mode="backbone", n_ctx=1024, n_threads=a.threads, n_threads_batch=a.threads, seed=0)
    prompts = [llm.tokenize(p.encode()) for p in PROMPTS]
    rows, same = [], []
    spec_stats = []
    for r in range(a.rounds):
        p = prompts[r % len(prompts)]
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        res = {}
        for m in order:
            llm.mode = m
            out, tps = gen(llm, p, a.tokens)
            res[m] = (out, tps)
            if m == "exact":
                spec_stats.append(llm.stats())
        if "exact" in res:
            same.append(res["exact"][0] == res["backbone"][0])
        rows.append({m: res[m][1] for m in modes})
        print(r, {m: round(v, 2) for m, v in rows[-1].items()}, "identical" if same and same[-1] else "", flush=True)
    ratios = {m: float(np.median([row[m] / row["backbone"] for row in rows])) for m in modes}
    tps = {m: float(np.median([row[m] for row in rows])) for m in modes}
    best = {m: float(max(row[m] for row in rows)) for m in modes}   # best round: closest to an idle machine
    summary = {"model": a.name, "gguf": a.gguf, "threads": a.threads, "tokens": a.tokens, "rounds": a.rounds,
               "tok_s_median": tps, "ratio_to_backbone_median": ratios,
               "tok_s_best": best, "ratio_of_best": {m: best[m] / best["backbone"] for m in modes},
               "load_average_1min": __import__("os").getloadavg()[0], "rows": rows,
               "exact_identical_all_rounds": all(same)}
    if spec_stats:
        acc = sum(s["accepted"] for s in spec_stats) / max(sum(s["drafted"] for s in spec_stats), 1)
        cyc = sum(s["cycles"] for s in spec_stats)
        summary["exact"] = {"acceptance_rate": acc,
                            "mean_draft_len": sum(s["drafted"] for s in spec_stats) / max(cyc, 1),
                            "tokens_per_cycle": sum(s["tokens"] for s in spec_stats) / max(cyc, 1)}
        cm = next(iter(v for k, v in _COSTS.items() if k[0] == a.gguf), None)
        if cm is not None:
            ks = list(range(0, len(cm.verify_s) - 1))
            pred = [cm.rate(k, acc) * cm.curve()[1] for k in ks]
            summary["cost_model"] = dict(cm.as_dict(), acceptance=acc,
                                         predicted_speedup_by_k=dict(zip(ks, pred)),
                                         best_k=int(np.argmax(pred)), predicted_best=max(pred),
                                         draft_over_backbone_step=cm.draft_s / cm.curve()[1])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"spec_{a.name}.json").write_text(json.dumps(summary, indent=1))
    _plot(summary, a.out / f"spec_{a.name}.png")
    print(json.dumps({k: summary[k] for k in summary if k != "rows"}, indent=1))
    return 0


def _plot(s: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(s["tok_s_median"])
    ax[0].bar(modes, [s["tok_s_median"][m] for m in modes], color=["0.5", "C0", "C1", "C2"][: len(modes)])
    for i, m in enumerate(modes):
        ax[0].text(i, s["tok_s_median"][m], f"{s['ratio_to_backbone_median'][m]:.2f}x", ha="center", va="bottom")
    ax[0].set_ylabel("decode tok/s (median over rounds)")
    ax[0].set_title(f"{s['model']}: greedy, {s['threads']} threads"
                    + (", exact output identical" if s.get("exact_identical_all_rounds") else ""))
    cm = s.get("cost_model")
    if cm:
        ks = [int(k) for k in cm["predicted_speedup_by_k"]]
        ax[1].plot(ks, list(cm["predicted_speedup_by_k"].values()), "o-", label=f"a={cm['acceptance']:.3f}")
        ax[1].axhline(1, color="0.6", lw=0.8)
        ax[1].set_xlabel("draft length k")
        ax[1].set_ylabel("predicted speed-up (cost model)")
        ax[1].set_title(f"draft {cm['draft_ms']:.1f} ms; verify(1..) " +
                        " ".join(f"{v:.0f}" for v in cm["verify_ms"][:6]) + " ms", fontsize=9)
        ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
