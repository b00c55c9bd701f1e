"""The calibration report's figure: does each signal predict the damage of exiting, and quality against depth."""
from __future__ import annotations

from pathlib import Path

from river_edge.figure import pyplot, save


def calibration(summary: dict, path: str | Path, title: str = "") -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rho in summary["spearman_per_layer"].items():
        a.plot(range(len(rho)), rho, marker=".", label=name.replace("_", " "))
    a.axhline(0, color="grey", lw=0.8)
    a.set(xlabel="exit after layer l", ylabel="Spearman(signal, KL of exiting at l)",
          title="Does the signal predict the damage? (test prompts)", ylim=(-1, 1))
    a.legend(fontsize=8)

    sweep = summary["test_clean_sweep"]
    b.plot([p["depth"] for p in sweep], [p["kl"] for p in sweep], color="C0", alpha=0.5,
           label=f"{summary['rule']} rule sweep (clean cache)")
    t = summary["test"]
    L = t["backbone"]["depth"]
    b.plot([0, L], [t["all_river"]["kl"], 0], ls="--", color="grey", lw=0.8, label="random mix, ideal line")
    for key, style in (("rule", "C0o"), ("random_same_depth", "C3s"), ("all_river", "kD"), ("backbone", "g^")):
        b.plot(t[key]["depth"], t[key]["kl"], style, ms=8, label=f"{key.replace('_', ' ')} (online)")
    b.set(xlabel="mean backbone layers per decode token", ylabel="mean KL vs backbone",
          title="Quality against depth (test prompts)")
    b.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    save(fig, path)
    plt.close(fig)
    return path
