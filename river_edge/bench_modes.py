"""Decoding-mode benchmark (`river bench --mode exact,gated,river,fast,backbone`).

Every mode of one RiverLlama (river_edge/spec.py), plus plain Q8_0 and Q4_0 files beside them, greedy through
`generate()` (the path chat, completions and the server take), on the same chat prompts, in one process,
the order rotating every round. Per configuration: median over (round, prompt) of its tok/s divided by the
backbone's tok/s of the same round and prompt; how many of its tokens equal the backbone's (the common
prefix, in tokens; exact mode must give all of them); and the mode's telemetry (acceptance, draft length
and cost model for exact, fallback rate for gated, mean backbone depth for river).
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import bench as B
from .format import RiverError
from .spec import MODES

PLAIN = ("q8_0", "q4_0", "shipped")  # stock files: plain quantizations, and the source file itself
DEFAULTS = dict(tokens=64, rounds=3, n_prompts=4)
QUICK = dict(tokens=12, rounds=1, n_prompts=1)


def parse_modes(text: str) -> list[str]:
    modes = [m.strip().lower() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES + PLAIN]
    if bad or not modes:
        raise RiverError(f"--mode: unknown mode {bad[0] if bad else text!r}: use a comma list of "
                         f"{', '.join(MODES + PLAIN)}")
    return list(dict.fromkeys(modes))


def _gen(llm, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """n greedy tokens after the first; (tokens, decode tok/s, request seconds). Every configuration is
    timed from the same two points: the request (prefill included) and the first token, which every mode
    takes from the prompt's logits (exact mode included), to the n-th token after it."""
    llm.reset()
    out, t0 = [], None
    t_req = time.perf_counter()
    for tok in llm.generate(prompt, temp=0.0, reset=True):
        if t0 is None:
            t0 = time.perf_counter()
        else:
            out.append(int(tok))
        if len(out) >= n:
            break
    t1 = time.perf_counter()
    return out, len(out) / (t1 - t0), t1 - t_req


def bootstrap_ci(x, level: float = 0.95, n: int = 2000, seed: int = 0) -> list[float]:
    """Percentile bootstrap interval of the median of x."""
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    med = np.median(rng.choice(x, size=(n, len(x)), replace=True), axis=1)
    return [float(np.quantile(med, (1 - level) / 2)), float(np.quantile(med, (1 + level) / 2))]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(river_path: str | Path, modes: Sequence[str], *, threads: int = B.DEFAULT_THREADS,
        tokens: int = DEFAULTS["tokens"], rounds: int = DEFAULTS["rounds"], n_prompts: int = DEFAULTS["n_prompts"],
        prompts: Sequence[str] | None = None, progress=None) -> dict:
    from .tokenizer import Tokenizer

    say = progress or B._quiet
    if tokens < 2 or rounds < 1 or threads < 1:
        raise RiverError("tokens must be at least 2, rounds and threads at least 1")
    river_path = Path(river_path)
    files, notes = B.prepare_files(river_path, say, shipped="shipped" in modes)
    cfgs = ["backbone"] + [m for m in modes if m != "backbone"]
    texts = list(prompts) if prompts else B.packaged_prompts(n_prompts)
    chats = [Tokenizer(river_path).chat(t) for t in texts]
    n_ctx = max(len(c) for c in chats) + tokens + 16
    from .host import host, placement
    from .runtime import RiverLlama

    def load(path):
        return RiverLlama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=0)

    llm = load(files["river"])
    if not llm.has_river:
        raise RiverError(f"{river_path}: the runtime sees no river in it (is the patched llama-cpp-python installed?)")
    if "shipped" in cfgs and "shipped" not in files:
        raise RiverError("shipped: the file this river GGUF was built from is not in the model cache (found only "
                         "for the offline models: `river models prepare NAME`)")
    plain = {q: load(files[q]) for q in cfgs if q in PLAIN}

    def decode(c, p):
        if c in PLAIN:
            return _gen(plain[c], p, tokens), {}
        llm.mode = c
        if c == "river":
            llm.reset_stats()
        out = _gen(llm, p, tokens)
        st = llm.stats()
        if c == "river":
            st["hist"] = llm.exit_histogram().tolist()
        return out, st

    say("warming up", 0, len(cfgs))
    for i, c in enumerate(cfgs):      # graphs, page touches, and the exact mode's cost model
        decode(c, chats[0])
        say("warming up", i + 1, len(cfgs))
    load_before = B._load_avg()
    rows = []                          # one per (round, prompt): {config: tok/s}, {config: common prefix}
    stats: dict[str, list[dict]] = {c: [] for c in cfgs}
    total, done = rounds * len(chats) * len(cfgs), 0
    t_start = time.time()
    for r in range(rounds):
        order = cfgs[r % len(cfgs):] + cfgs[: r % len(cfgs)]
        for pi, p in enumerate(chats):
            toks, tps, req = {}, {}, {}
            for c in order:
                (toks[c], tps[c], req[c]), st = decode(c, p)
                stats[c].append(st)
                done += 1
                say(f"round {r + 1}/{rounds}", done, total)
            rows.append({"round": r, "prompt": pi, "tok_s": tps, "request_s": req,
                         "common_prefix": {c: _common(toks[c], toks["backbone"]) for c in cfgs}})
    res = dict(
        kind="modes", model=B._stem(river_path), river_gguf=str(river_path), files={k: str(v) for k, v in files.items()},
        weights=B.weights_note(notes), notes=notes, threads=threads, tokens=tokens, rounds=rounds, prompts=texts,
        prompt_tokens=[len(c) for c in chats], elapsed_s=time.time() - t_start, load_before=load_before,
        load_after=B._load_avg(), cpu_count=os.cpu_count(), rows=rows, configs={},
        # the host and where ggml put each file's weights: figures from other hosts never share a table
        host=host(threads), buffer_types={"river": placement(llm), **{q: placement(m) for q, m in plain.items()}})
    for c in cfgs:
        ratio = [row["tok_s"][c] / row["tok_s"]["backbone"] for row in rows]
        req = [row["request_s"]["backbone"] / row["request_s"][c] for row in rows]
        same = [row["common_prefix"][c] for row in rows]
        d = {"tok_s_median": float(np.median([row["tok_s"][c] for row in rows])),
             "ratio_median": float(np.median(ratio)), "ratio_min": float(min(ratio)), "ratio_max": float(max(ratio)),
             "ratio_ci95": bootstrap_ci(ratio),
             "request_ratio_median": float(np.median(req)), "request_ratio_ci95": bootstrap_ci(req),
             "identical_runs": sum(s == tokens for s in same), "runs": len(same),
             "common_prefix_mean": float(np.mean(same)),
             "file_mib": files[c if c in PLAIN else "river"].stat().st_size / 2**20}
        d.update(_telemetry(c, stats[c], llm.n_layer))
        res["configs"][c] = d
    return res


def _telemetry(c: str, sts: list[dict], n_layer: int) -> dict:
    if c == "exact":
        drafted, acc = sum(s["drafted"] for s in sts), sum(s["accepted"] for s in sts)
        cycles, toks = sum(s["cycles"] for s in sts), sum(s["tokens"] for s in sts)
        return {"acceptance_rate": acc / drafted if drafted else None, "mean_draft_len": drafted / max(cycles, 1),
                "tokens_per_cycle": toks / max(cycles, 1), "cost_model": sts[-1].get("cost_model")}
    if c == "gated":
        fb, toks = sum(s["fallbacks"] for s in sts), sum(s["tokens"] for s in sts)
        return {"fallback_rate": fb / max(toks, 1), "gate_entropy": sts[-1].get("gate_entropy")}
    if c == "river":
        h = np.sum([s["hist"] for s in sts], axis=0)
        return {"mean_depth": float((h * np.arange(n_layer + 1)).sum() / max(h.sum(), 1)), "hist": h.tolist()}
    return {}


def note(c: str, d: dict, res: dict) -> str:
    """The telemetry worth a word for configuration c: acceptance, fallback rate, depth or file size."""
    if d.get("acceptance_rate") is not None:
        return f"acceptance {d['acceptance_rate']:.2f}, {d['tokens_per_cycle']:.1f} tokens per cycle"
    if "fallback_rate" in d:
        return f"fallback rate {d['fallback_rate']:.2f}"
    if "mean_depth" in d:
        return f"backbone layers {d['mean_depth']:.1f}/{res['notes']['n_layer']}"
    if c in PLAIN:
        return f"plain file {d['file_mib']:.0f} MiB (river GGUF {res['configs']['backbone']['file_mib']:.0f})"
    return ""


def format_table(res: dict) -> str:
    lines = [f"{res['model']}: {res['weights']}",
             f"greedy, {res['tokens']} tokens x {len(res['prompts'])} chat prompts x {res['rounds']} rounds, "
             f"{res['threads']} threads, load average {res['load_before']['loadavg_1_5_15'][0]}",
             f"{'config':10} {'tok/s':>7} {'x backbone':>10} {'(min-max)':>12} {'same as backbone':>17}  notes"]
    for c, d in res["configs"].items():
        lines.append(f"{c:10} {d['tok_s_median']:7.1f} {d['ratio_median']:9.2f}x {d['ratio_min']:5.2f}-{d['ratio_max']:<5.2f} "
                     f"{d['identical_runs']:>5}/{d['runs']} runs ({d['common_prefix_mean']:.0f} tok)  {note(c, d, res)}")
    return "\n".join(lines)


def figure(res: dict, path: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = list(res["configs"])
    d = res["configs"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    color = ["0.5" if c == "backbone" else "C2" if c in PLAIN else "C0" for c in cs]
    ax[0].bar(cs, [d[c]["ratio_median"] for c in cs], color=color)
    ax[0].errorbar(range(len(cs)), [d[c]["ratio_median"] for c in cs],
                   yerr=[[d[c]["ratio_median"] - d[c]["ratio_min"] for c in cs],
                         [d[c]["ratio_max"] - d[c]["ratio_median"] for c in cs]], fmt="none", ecolor="k", lw=0.8)
    for i, c in enumerate(cs):
        ax[0].text(i, d[c]["ratio_median"], f"{d[c]['ratio_median']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax[0].axhline(1, color="0.6", lw=0.8)
    ax[0].set_ylabel("decode speed / backbone (median, min-max)")
    ax[0].set_title(f"{res['model']}: greedy, {res['threads']} threads", fontsize=10)
    ax[1].bar(cs, [d[c]["common_prefix_mean"] / res["tokens"] for c in cs], color=color)
    ax[1].set_ylabel(f"share of the {res['tokens']} tokens equal to the backbone's\n(common prefix, mean)")
    ax[1].set_ylim(0, 1.05)
    ax[1].set_title("exact must be 1.0; plain quantization shown beside every river mode", fontsize=9)
    for a in ax:
        a.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
