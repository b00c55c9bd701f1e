"""v(n): what verifying n tokens in one batch costs, in one-token steps, per host and weight type (issue 42).

Exact mode pays only where k drafts plus a batch of k + 1 cost less than the tokens they yield would cost one at a
time (docs/design.md, "What each method can pay"). For each file: a one-token step, then batches of n = 1..9 tokens
on two paths, alternating, each size repeated:
- stock: the batch as llama.cpp runs it (its batched kernels, CPU_REPACK's where the weights are repacked);
- exact: the batch on ggml's reference kernels (patches/0013), as exact mode verifies, whose rows are meant to carry
  one-token bits;
and how far each path's rows depart from the same tokens decoded one at a time (max |logit| difference; 0: bit for
bit). The files: each zoo model's shipped GGUF (their weights span Q4_1, Q5_0, Q4_K, Q6_K and Q8_0 heads), and where
they are cached, SmolLM2's plain Q8_0 and Q4_0 and its F16 upcast (`river bench` writes them beside its river).
Writes bench/results/hosts/<host>/vcost.json.

    .venv/bin/python -m bench.vcost [--reps 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.builds import load_builds, words
from bench.head import CHAT
from bench.recorded import host_folder
from river_edge import zoo
from river_edge.gguf_tools import inspect_gguf
from river_edge.host import host
from river_edge.runtime.headrank import chat_tokens
from river_edge.runtime.llama import RiverLlama

_HERE = Path(__file__).resolve().parent
N = 9


def files() -> dict[str, Path]:
    out = {f"{m} (shipped)": zoo.prepare(m) for m in zoo.MODELS if zoo.MODELS[m].supported}
    rivers = zoo.cache_dir() / "rivers"
    for name, f in (("smollm2-135m plain q8_0", "smollm2-135m.plain.q8_0.gguf"),
                    ("smollm2-135m plain q4_0", "smollm2-135m.plain.q4_0.gguf"),
                    ("smollm2-135m f16 upcast", "smollm2-135m.backbone.gguf")):
        if (rivers / f).is_file():
            out[name] = rivers / f
    return out


def measure(path: Path, reps: int, threads: int) -> dict:
    llm = RiverLlama(str(path), mode="backbone", n_ctx=1024, n_threads=threads, n_threads_batch=threads, seed=0)
    dec = llm.decoder
    dec.decode_threads(True)   # batches on the decode threads, as exact mode verifies
    prompt = chat_tokens(llm, CHAT[0])
    row = dec.prefill(prompt, True)
    pos = dec.n_tokens
    seq = [int(row.argmax())]   # the model's own next tokens: a real draft's context
    for i in range(N - 1):
        seq.append(int(dec.decode([seq[-1]], pos + i)[0].argmax()))
    dec.remove(pos)
    single = []
    for i, t in enumerate(seq):
        single.append(np.array(dec.decode([t], pos + i)[0]))
    dec.remove(pos)
    ms = {"step": [], "stock": {n: [] for n in range(1, N + 1)}, "exact": {n: [] for n in range(1, N + 1)}}
    dev = {"stock": [0.0] * N, "exact": [0.0] * N}
    rng = np.random.default_rng(0)
    for r in range(reps + 1):   # the first round builds each batch size's graph: not counted
        t0 = time.perf_counter()
        dec.decode([seq[0]], pos)
        dec.remove(pos)
        if r:
            ms["step"].append(1e3 * (time.perf_counter() - t0))
        for n in rng.permutation(np.arange(1, N + 1)):
            for path_ in ("stock", "exact"):
                t0 = time.perf_counter()
                rows = np.array(dec.verify(seq[:n], pos, invariant=path_ == "exact"))
                dt = time.perf_counter() - t0
                dec.remove(pos)
                if r:
                    ms[path_][n].append(1e3 * dt)
                d = float(max(np.abs(rows[i] - single[i]).max() for i in range(n)))
                dev[path_][n - 1] = max(dev[path_][n - 1], d)
    step = float(np.median(ms["step"]))
    info = inspect_gguf(path)
    res = {"path": path.name, "weight_types": info["backbone_types"], "step_ms": round(step, 3),
           "step_ms_all": [round(x, 3) for x in ms["step"]]}
    for p in ("stock", "exact"):
        med = [float(np.median(ms[p][n])) for n in range(1, N + 1)]
        res[p] = {"ms": [round(x, 3) for x in med], "v": [round(x / step, 3) for x in med],
                  "departure": [round(x, 5) for x in dev[p]],
                  "rows_exact_up_to": next((n for n in range(N, 0, -1) if not any(dev[p][:n])), 0)}
    llm.close()
    return res


def table(folder: Path, sub: str = "") -> list[str]:
    """docs/results.md's v(n) table for one host folder, `sub` its path under bench/results/ (empty where it has no
    vcost.json)."""
    p = folder / "vcost.json"
    if not p.is_file():
        return []
    r = json.loads(p.read_text())
    h = r["host"]
    lines = [f"v(n), the cost of verifying n tokens in one batch in one-token steps, on {h['cpu']['model']} "
             f"({h['threads']} threads, {words(h['runtime'].get('build'), load_builds())}; "
             f"`bench/results/{sub}vcost.json`, `python -m bench.vcost`). Exact: the batch on ggml's reference "
             "kernels, as exact mode verifies; "
             "stock: llama.cpp's own batch. Rows: the largest batch whose every row equals a one-token decode, bit "
             "for bit (exact mode verifies no larger batch).", "",
             "| file | weights | step, ms | exact v(2) | v(3) | v(4) | v(5) | v(9) | rows | stock v(4) | stock rows |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in r["files"].items():
        w = ", ".join(t for t in f["weight_types"] if t != "f32")
        e, s = f["exact"], f["stock"]
        lines.append(f"| {name} | {w} | {f['step_ms']:.1f} | " + " | ".join(f"{e['v'][n - 1]:.2f}" for n in (2, 3, 4, 5, 9))
                     + f" | {e['rows_exact_up_to']} | {s['v'][3]:.2f} | {s['rows_exact_up_to']} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    out = {"host": host(a.threads), "n": list(range(1, N + 1)), "reps": a.reps,
           "note": "v(n) = a batch of n tokens / one one-token step, medians over reps (the first round, which builds "
                   "the graphs, not counted); departure: max |logit| of the batch's rows against one-token decodes",
           "files": {}}
    for name, path in files().items():
        out["files"][name] = r = measure(path, a.reps, a.threads)
        print(f"{name}: step {r['step_ms']:.1f} ms; v(n) stock {r['stock']['v']}; exact {r['exact']['v']} "
              f"(rows exact up to {r['exact']['rows_exact_up_to']})", flush=True)
    rec = host_folder(_HERE / "results", out["host"]) / "vcost.json"
    rec.parent.mkdir(parents=True, exist_ok=True)
    rec.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {rec}")


if __name__ == "__main__":
    main()
