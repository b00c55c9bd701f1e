"""The gated mode's gate (river_edge/runtime/spec.py): the river's output entropy above which the backbone re-decodes
a token, fitted to a quality target; stored as river.gate_entropy.

Per decode token of the recorded backbone decodes, the all-river logits computed clean (exit layer -1):
KL(backbone || river), top-1 agreement, the river's entropy and top-1 margin. A token whose signal crosses
the gate falls back to the backbone (KL 0, agreement 1), so the fit is a sort. The report compares with
random fallback at the same rate, whose expected KL is (1 - rate) * mean KL. Clean figures: online,
river-written K/V of the tokens that do not fall back pollute later ones (docs/design.md §6 item 6: about
2x).
"""
from __future__ import annotations

import numpy as np
import torch

from ..format import RiverError
from ..reference import Policy
from .parallel import gated_passes, prefilled
from .record import entropy, kl_div
from .rule import spearman
from .target import Settings, Target


def online_gated(model, ref: dict, gate: float, batch: int, guess_from: list | None = None,
                 entropies: list | None = None) -> dict:
    """The gated mode teacher-forced over the reference's tokens as it runs: every token on the river first,
    re-decoded on the backbone (its cells rewritten) where the river's entropy >= gate, so the river-written
    K/V of the tokens that did not fall back feed later ones. Each prompt's tokens in a few passes, the batch's
    prompts together (parallel.gated_passes), where online_gated_stepwise() runs one step per token.

    guess_from: per prompt (ref's order), the river's entropy per token from an earlier check of these prompts; the
    passes take "entropy >= gate" as their first guess (the result does not depend on it; at the next gate down
    nearly every token keeps its guess, and the check runs far fewer passes). entropies: a list that receives this
    check's, for the next."""
    kls, agrees, falls, passes = [], [], [], []
    items = list(ref.values())
    with torch.no_grad():
        for b0 in range(0, len(items), batch):
            chunk = items[b0:b0 + batch]
            caches = prefilled(model, chunk, Policy.backbone())
            guesses = [g >= gate for g in guess_from[b0:b0 + batch]] if guess_from is not None else None
            done = gated_passes(model, caches, [t for _, t, _ in chunk], gate, entropy, guesses=guesses)
            for (_, t, lp), (lg, fall, n, ent) in zip(chunk, done):
                kls.append(kl_div(lp[:len(t)], lg))
                agrees.append((lg.argmax(-1) == lp[:len(t)].argmax(-1)).float())
                falls.append(fall.float())
                passes.append(n)
                if entropies is not None:
                    entropies.append(ent)
    mean = lambda xs: float(torch.cat(xs).mean())
    return {"kl": mean(kls), "agreement": mean(agrees), "fallback_rate": mean(falls),
            "tokens_per_prompt": min(len(t) for _, t, _ in items), "passes": max(passes)}


def online_gated_stepwise(model, ref: dict, gate: float, batch: int) -> dict:
    """online_gated(), one RiverModel.step per decode token (the reference its passes are tested against)."""
    kls, agrees, falls = [], [], []
    items = list(ref.values())
    with torch.no_grad():
        for b0 in range(0, len(items), batch):
            chunk = items[b0:b0 + batch]
            caches = prefilled(model, chunk, Policy.backbone())
            for i in range(len(chunk[0][1])):
                st = model.step([([t[i]], c) for (_, t, _), c in zip(chunk, caches)], Policy(forced=-1),
                                per_sequence=True)
                lg = [x[-1] for x in st.logits]
                back = [b for b in range(len(chunk)) if float(entropy(lg[b])) >= gate]
                if back:
                    for b in back:
                        caches[b].truncate(caches[b].n - 1)
                    again = model.step([([chunk[b][1][i]], caches[b]) for b in back], Policy.backbone(),
                                       per_sequence=True)
                    for b, x in zip(back, again.logits):
                        lg[b] = x[-1]
                lg = torch.stack(lg)
                ref_lp = torch.stack([lp[i] for _, _, lp in chunk])
                kls.append(kl_div(ref_lp, lg))
                agrees.append((lg.argmax(-1) == ref_lp.argmax(-1)).float())
                falls.append(torch.tensor([float(b in back) for b in range(len(chunk))]))
    mean = lambda xs: float(torch.cat(xs).mean())
    return {"kl": mean(kls), "agreement": mean(agrees), "fallback_rate": mean(falls),
            "tokens_per_prompt": min(len(t) for _, t, _ in items)}


def _at(rec: dict, fall: np.ndarray) -> dict:
    return {"kl": float(np.where(fall, 0.0, rec["kl"]).mean()),
            "agreement": float(np.where(fall, 1.0, rec["agree"]).mean()),
            "fallback_rate": float(fall.mean())}


def gate_metrics(rec: dict, gate: float, signal: str = "entropy") -> dict:
    """Quality at a gate (entropy: fall back when >= gate; margin: when <= gate), with random fallback
    at the same rate (expected values) beside it."""
    fall = rec["entropy"] >= gate if signal == "entropy" else rec["margin"] <= gate
    m = _at(rec, fall)
    r = m["fallback_rate"]
    m["random"] = {"kl": float((1 - r) * rec["kl"].mean()),
                   "agreement": float(1 - (1 - r) * (1 - rec["agree"].mean()))}
    return m


def fit_gate(rec: dict, target: Target) -> float:
    """The highest entropy gate (fewest fallbacks) meeting the target on `rec`."""
    if target.kind not in ("kl", "agreement"):
        raise RiverError("the gate fits a kl or agreement target")
    h = rec["entropy"]
    cand = np.concatenate([[np.inf], np.sort(h)[::-1]])        # falling back on more and more tokens
    for g in cand:
        if target.met({**_at(rec, h >= g), "depth": 0}):
            return float(g)
    return 0.0


def sweep(rec: dict, rates=(0.05, 0.1, 0.2, 0.3, 0.5)) -> list[dict]:
    out = []
    for r in rates:
        g_e = float(np.quantile(rec["entropy"], 1 - r))
        g_m = float(np.quantile(rec["margin"], r))
        out.append({"rate": r, "entropy": gate_metrics(rec, g_e), "margin": gate_metrics(rec, g_m, "margin")})
    return out


def gate_target(target: Target) -> Target:
    """The gate fits a KL or agreement target; a depth target (the rule's) gives way to the default KL."""
    return target if target.kind in ("kl", "agreement") else Target("kl", 0.05)  # defaults.DEFAULT_TARGET


def compact(summary: dict) -> dict:
    return {k: summary[k] for k in ("target", "gate_entropy", "test", "test_online", "target_met_online",
                                    "test_all_river", "fit_online_checks")}


def _scaled(target: Target, inflation: float) -> Target:
    """The target on clean figures that, with KL / disagreement inflated online by `inflation`, meets it."""
    if target.kind == "kl":
        return Target("kl", target.value / inflation)
    return Target("agreement", 1 - (1 - target.value) / inflation)


def gate_report(model, fit: dict, test: dict, target: Target, s: Settings, tick=lambda n: None) -> dict:
    """Fit the gate on the fit prompts' recordings and report it on the test prompts' (record()'s aux: the
    all-river figures under "gate", the backbone's reference under "ref"). Fitted on clean figures, then checked
    online over online_tokens and tightened (as the rule is) until it meets the target there. tick(n): n prompts
    checked online (3 fit checks at most, then the test's)."""
    fit_rec, fit_ref, test_rec, test_ref = fit["gate"], fit["ref"], test["gate"], test["ref"]
    inflation, checks, ents = 1.0, 0, None
    for _ in range(3):
        checks += 1
        gate = fit_gate(fit_rec, _scaled(target, inflation))
        got: list = []   # this check's river entropies: the next check's first guesses, at its lower gate
        fit_online = online_gated(model, fit_ref, gate, s.batch, guess_from=ents, entropies=got)
        ents = got
        tick(len(fit_ref))
        if target.met({**fit_online, "depth": 0}):
            break
        clean = gate_metrics(fit_rec, gate)
        ratio = (fit_online["kl"] / max(clean["kl"], 1e-9)) if target.kind == "kl" else \
            (1 - fit_online["agreement"]) / max(1 - clean["agreement"], 1e-9)
        inflation = max(inflation * 1.25, ratio)
    tick(len(fit_ref) * (3 - checks))   # the checks it did not need
    test_online = online_gated(model, test_ref, gate, s.batch)
    tick(len(test_ref))
    summary = {"target": {"kind": target.kind, "value": target.value}, "gate_entropy": gate,
               "fit": gate_metrics(fit_rec, gate), "fit_online": fit_online, "fit_online_checks": checks,
               "test": gate_metrics(test_rec, gate), "test_online": test_online,
               "target_met_online": target.met({**test_online, "depth": 0}),
               "test_all_river": {"kl": float(test_rec["kl"].mean()), "agreement": float(test_rec["agree"].mean())},
               "spearman_entropy_kl": spearman(test_rec["entropy"], test_rec["kl"]),
               "spearman_margin_kl": spearman(-test_rec["margin"], test_rec["kl"]),
               "test_sweep": sweep(test_rec)}
    return summary


def gate_line(g: dict) -> str:
    """One sentence on the fitted gate, online first (the figure a user gets), clean beside it."""
    t, o, tg = g["test"], g.get("test_online"), g["target"]
    s = f"gated mode: fall back to the backbone at river entropy >= {g['gate_entropy']:.3g} nats."
    if o is not None:
        kind, want = tg["kind"], tg["value"]
        got = o["kl"] if kind == "kl" else o["agreement"]
        s += (f" On unseen prompts, online over {o['tokens_per_prompt']} tokens: fallback {o['fallback_rate']:.2f}, "
              f"KL {o['kl']:.4f}, top-1 {o['agreement']:.3f} (target {kind} {'<=' if kind == 'kl' else '>='} {want:g} "
              + ("met)." if g["target_met_online"] else f"not met: {abs(got - want):.2g} off).")
              + " Clean (the river reading the backbone's K/V):")
    else:
        s += " On unseen prompts, clean (the river reading the backbone's K/V):"
    return s + (f" fallback {t['fallback_rate']:.2f}, KL {t['kl']:.4f}, top-1 {t['agreement']:.3f}; random fallback at "
                f"that rate KL {t['random']['kl']:.4f}, top-1 {t['random']['agreement']:.3f}.")
