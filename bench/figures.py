"""The results pages' own figures (matplotlib, no display needed): long and batched runs, quality against speed,
accuracy against speed, exit depth. `river bench`'s two (runtime, modes) are the product's, drawn again here
beside their JSON."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from river_edge.figure import pyplot as _plt, save
from river_edge.measure.plots import modes, runtime  # noqa: F401  (the pages draw every figure from this module)


def _rolling(x: Sequence[float], w: int) -> tuple[np.ndarray, np.ndarray]:
    """Trailing mean over w positions (fewer at the start): (positions, means)."""
    x = np.asarray(x, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(i - w, 0)
    return i - 1, (c[i] - c[lo]) / (i - lo)


def longrun(long: dict | None, batch: dict | None, path, w: int = 64) -> Path:
    """Left: KL vs position of each mode of the long run; right: each sequence of the batch run, batched
    (solid) and alone (dashed). Trailing means over w tokens."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    title = []
    if long:
        lo, hi = math.inf, 0.0
        for m, r in long["modes"].items():
            x, y = _rolling(r["kl"], w)
            lo, hi = min(lo, y.min()), max(hi, y.max())
            depth = f", depth {r['mean_depth']:.1f}/{long['n_layer']}" if "mean_depth" in r else ""
            a.plot(x, y, label=f"{m}: mean KL {r['kl_mean']:.3g}, agree {r['agreement']:.1%}{depth}")
        a.set(xlabel="generated token", ylabel=f"KL(backbone || mode), nats, mean of last {w}",
              title=f"One generation of {long['n_tokens']} tokens (backbone's greedy text)")
        if lo > 0:  # river and fast KL can be 10x apart: log, floored (a first step on the backbone is ~1e-15)
            a.set_yscale("log")
            a.set_ylim(max(lo, hi * 1e-3), hi * 1.5)
        else:  # a mode equal to the backbone (KL 0 or -1e-15)
            a.set_ylim(bottom=0)
        a.legend(fontsize=8)
        title.append(f"{long['model']}, {long['threads']} threads")
    else:
        a.text(0.5, 0.5, "long run: not run", ha="center", va="center", transform=a.transAxes)
        a.set_axis_off()
    if batch:
        for s, q in enumerate(batch["sequences"]):
            for key, ls in (("batch", "-"), ("alone", "--")):
                x, y = _rolling(q[key]["kl"], w)
                b.plot(x, y, ls=ls, color=f"C{s}", label=f"seq {s} {key}: mean KL {q[key]['kl_mean']:.3g}")
        b.set(xlabel="generated token", ylabel=f"KL(backbone || river rule), mean of last {w}",
              title=f"{batch['n_seq']} sequences in one batch (solid) vs alone (dashed); depth "
                    f"{batch['batch_mean_depth']:.1f} vs {batch['alone_mean_depth']:.1f}/{batch['n_layer']}",
              ylim=(0, None))
        b.legend(fontsize=7, ncol=2)
        title.append(f"batch: {batch['model']}, {batch['threads']} threads, {batch['n_tokens']} tokens/seq")
    else:
        b.text(0.5, 0.5, "batch run: not run", ha="center", va="center", transform=b.transAxes)
        b.set_axis_off()
    fig.suptitle("; ".join(title), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    save(fig, path)
    plt.close(fig)
    return path


def pareto(q: dict, modes: dict | None, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c, d in q["configs"].items():
        kind = "C2" if c.startswith("q") else "0.4" if c == "backbone" else "C1" if "random" in c else "C0"
        mk = "s" if c.startswith("q") else "x" if "random" in c else "o"
        ax.scatter(d["speed_ratio"], d["agreement"], color=kind, marker=mk)
        ax.annotate(c, (d["speed_ratio"], d["agreement"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if modes and "exact" in modes["configs"]:
        ax.scatter(modes["configs"]["exact"]["ratio_median"], 1.0, color="C3", marker="*", s=120)
        ax.annotate("exact", (modes["configs"]["exact"]["ratio_median"], 1.0), fontsize=7, xytext=(3, -10),
                    textcoords="offset points")
    ax.set_xlabel("decode speed / backbone")
    ax.set_ylabel("top-1 agreement with the backbone (held-out text)")
    ax.set_title(f"{q['model']}: river modes (blue), random (orange x), plain quantization (green), exact (red)",
                 fontsize=8)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


def pareto_accuracy(evals: dict[str, dict], path: Path) -> Path:
    plt = _plt()
    fig, axs = plt.subplots(1, len(evals), figsize=(4.5 * len(evals), 4), squeeze=False)
    for ax, (t, e) in zip(axs[0], evals.items()):
        for c, d in e["configs"].items():
            color = "C2" if c.startswith("q") else "0.4" if c == "backbone" else "C3" if c == "exact" else "C0"
            ax.scatter(d["speedup"] or 0, d["accuracy"], color=color)
            ax.annotate(c, (d["speedup"] or 0, d["accuracy"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"{t}: {e['problems']} problems", fontsize=9)
        ax.set_xlabel("decode speed / backbone")
        ax.set_ylabel("accuracy")
    fig.suptitle(f"{next(iter(evals.values()))['model']}: accuracy vs speed", fontsize=9)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path


def depth_hist(q: dict, path: Path) -> Path:
    plt = _plt()
    hs = {c: d["hist"] for c, d in q["configs"].items() if "hist" in d}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    L = q["n_layer"]
    w = 0.8 / max(len(hs), 1)
    for i, (c, h) in enumerate(hs.items()):
        h = np.asarray(h, float)
        ax.bar(np.arange(L + 1) + i * w, h / h.sum(), width=w, label=c)
    ax.set_xlabel("backbone layers run (exit layer + 1)")
    ax.set_ylabel("share of decode steps")
    ax.set_title(f"{q['model']}: exit depth, held-out text", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return path
