"""The PNG figures of `river bench` (matplotlib, no display needed): the runtime benchmark and the decoding modes
(calibration draws its own: river_edge/calibration/figure.py; the results pages' other figures are bench/figures.py's)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from river_edge.figure import pyplot as _plt, save


def river_vs_ideal_from_medians(res: dict) -> float:
    """The calibrated river's per-token time over the ideal line's at its mean depth, from the paired median
    ratios of each configuration (a second estimator beside the per-sample one: their gap is the noise)."""
    rows, L = res["configs"], res["n_layer"]
    r_ar = 1.0 / rows["all-river"]["decode_ratio"]
    return (1.0 / rows["river"]["decode_ratio"]) / (r_ar + rows["river"]["mean_depth"] / L * (1.0 - r_ar))


def runtime(res: dict, path: str | Path) -> Path:
    """`river bench`: speed against the backbone, and the forced-exit sweep against the ideal line."""
    plt = _plt()
    # Paired quantities only (ratios to the backbone of the same round and prompt): on a shared machine the
    # absolute medians of different configurations can come from different load phases.
    rows = res["configs"]
    main = [k for k in rows if not k.startswith("exit@")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    x = np.arange(len(main))
    w = 0.4
    bars = a.bar(x - w / 2, [rows[k]["decode_ratio"] for k in main], w, label="decode")
    pbars = a.bar(x + w / 2, [rows[k]["prefill_ratio"] for k in main], w, label="prefill (~200-token ubatch)",
                  color="C1", alpha=0.7)
    for bars_, key, col in ((bars, "decode", "k"), (pbars, "prefill", "C1")):
        for bar, k in zip(bars_, main):
            a.annotate(f"{rows[k][key + '_ratio']:.2f}x\n{rows[k][key + '_tps']:.0f}/s",
                       (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                       fontsize=6.5, color=col)
    a.axhline(1.0, color="grey", lw=0.8)
    a.set_xticks(x, [k + (f"\nd={rows[k]['mean_depth']:.1f}" if rows[k].get("river_on") else "") for k in main],
                 fontsize=8)
    a.set(ylabel="tok/s relative to the backbone (paired median)",
          title="Speed vs the backbone, same run (label: ratio, median tok/s)")
    a.legend(fontsize=8, loc="upper left")

    L = res["n_layer"]
    sw = res["sweep"]
    if sw:
        rel = lambda k: 1.0 / rows[k]["decode_ratio"]  # per-token time relative to the backbone
        r_ar = rel("all-river")
        xs = np.array([0, L])
        b.plot(xs, r_ar + xs / L * (1.0 - r_ar), "--", color="grey", label="ideal line (from all-river and backbone)")
        b.plot([s["backbone_layers"] for s in sw], [rel(f"exit@{s['exit']}") for s in sw], "o-", color="C0",
               label="forced exit after layer e (measured)")
        for s in sw:
            b.annotate(f"{s['ratio_to_ideal']:.3f}", (s["backbone_layers"], rel(f"exit@{s['exit']}")),
                       textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
        b.plot([0], [r_ar], "kD", label="all-river")
        b.plot([L], [1.0], "g^", ms=8, label="backbone (river off)")
        rv = rows["river"]
        b.plot([rv["mean_depth"]], [rel("river")], "r*", ms=12,
               label=f"river, calibrated ({rv.get('ratio_to_ideal_at_depth', float('nan')):.3f} x ideal per sample, "
                     f"{river_vs_ideal_from_medians(res):.3f} as drawn)")
        b.set(xlabel="layers run on the backbone (e + 1)", ylabel="time per decode token / backbone's",
              title="Forced-exit sweep vs the ideal line (label: measured / ideal, paired)")
        b.legend(fontsize=8)
    m = res["method"]
    fig.suptitle(f"{res['model']}: {res['weights']}\n{m['threads']} threads, {len(m['prompts'])} packaged calibration "
                 f"prompts (chat template) x {m['rounds']} rounds, {m['decode_tokens']} greedy tokens, prefill "
                 f"{m['prefill_tokens']} tokens; load avg {res['machine']['load_before']['loadavg_1_5_15'][0]}"
                 f"-{res['machine']['load_after']['loadavg_1_5_15'][0]}", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    save(fig, path)
    plt.close(fig)
    return path


def modes(res: dict, path: str | Path) -> Path:
    """`river bench --mode`: each configuration's speed and how much of its text is the backbone's."""
    plt = _plt()
    cs = list(res["configs"])
    d = res["configs"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    plain = set(res.get("files", {})) - {"river", "draft"}   # the stock files it compared
    color = ["0.5" if c == "backbone" else "C2" if c in plain else "C0" for c in cs]
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
    save(fig, path)
    plt.close(fig)
    return Path(path)
