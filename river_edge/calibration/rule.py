"""The rule on recorded signals (fit), online (the rule writing its own K/V over Settings.online_tokens
generated tokens, tightened until the target holds there), against random selection at the same depth,
and the verdict, worded from the numbers."""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, replace
from typing import Callable, Sequence

import numpy as np
import torch

from .. import format as F
from ..format import RiverError
from ..reference import Policy, RiverModel
from .parallel import decode_pass, prefilled
from .record import Trace, decode, kl_div, record
from .target import Settings, Target


# -- the rule on recorded signals ----------------------------------------------------------------------

def exits_of(sims: np.ndarray, tau: np.ndarray, m: int) -> np.ndarray:
    """Exit layer of every row under the rule (first l in [m, L-2] with s_l > tau_l, else L-1)."""
    L = sims.shape[1]
    if m >= L - 1:   # no layer to exit after (one layer, or the min exit layer is the last): the backbone
        return np.full(len(sims), L - 1)
    over = sims[:, m:L - 1] > tau[m:L - 1]
    first = over.argmax(1) + m
    return np.where(over.any(1), first, L - 1)


def predict(tr: Trace, e: np.ndarray) -> dict:
    r = np.arange(len(e))
    return {"depth": float(np.mean(e + 1)), "kl": float(tr.kl[r, e].mean()), "agreement": float(tr.agree[r, e].mean())}


def candidates(tr: Trace, rule: str, min_exit: Sequence[int]):
    """(thresholds, min exit layer) of the rule family: per-layer quantiles, or one tau for all layers."""
    L = tr.sims.shape[1]
    qs = np.linspace(0, 1, 81)
    for m in min_exit:
        if m >= L - 1:
            continue   # no layer the rule may exit after: its only member is the backbone
        for q in qs:
            if rule == "per-layer":
                tau = np.quantile(tr.sims, q, axis=0)
            else:
                tau = np.full(L, np.quantile(tr.sims[:, m:L - 1], q))
            # the format's range (no negative thresholds): a quantile below 0 becomes 0, one past 1 by rounding 1;
            # the predictions below use the clipped rule
            tau = np.clip(tau, 0.0, 1.0).astype(np.float32)
            if q == 0:
                # exit at m whatever the similarity (the lowest quantile itself is no "over"): 0, the lowest
                # threshold the format allows, as a residual layer never turns its state by 90 degrees
                tau[:] = 0.0
            tau[:m] = np.inf
            tau[L - 1] = np.inf
            yield tau, m, float(q)


def fit(tr: Trace, target: Target, rule: str, inflation: float) -> dict:
    """The cheapest rule (least backbone depth) whose clean figures, with KL and disagreement scaled by
    the measured clean-to-online inflation, meet the target; for a depth target the least KL."""
    L = tr.sims.shape[1]
    best = shallowest = None
    for tau, m, q in candidates(tr, rule, range(1, L - 1)):
        p = predict(tr, exits_of(tr.sims, tau, m))
        # the clean-to-online inflation of the target's own figure (online exits run deeper or do more damage)
        online = dict(p, kl=p["kl"] * inflation, agreement=1 - (1 - p["agreement"]) * inflation,
                      depth=p["depth"] * inflation if target.kind == "depth" else p["depth"])
        choice = (p["depth"], dict(thresholds=tau, min_exit_layer=m, quantile=q, clean=p))
        shallowest = choice if shallowest is None or choice[0] < shallowest[0] else shallowest
        if not target.met(online):
            continue
        key = (p["kl"], p["depth"]) if target.kind == "depth" else (p["depth"], p["kl"])
        if best is None or key < best[0]:
            best = (key, choice[1])
    if best is None and target.kind == "depth" and shallowest is not None:
        return shallowest[1]   # no rule is that shallow: the shallowest (the backbone would be the deepest)
    if best is None:  # only the backbone meets it
        return backbone_fit(tr)
    return best[1]


def backbone_fit(tr: Trace) -> dict:
    """The rule that never exits (thresholds +inf): the backbone's output."""
    L = tr.sims.shape[1]
    return dict(thresholds=np.full(L, np.inf, np.float32), min_exit_layer=min(F.DEFAULT_MIN_EXIT_LAYER, L - 1),
                quantile=1.0, clean=predict(tr, np.full(len(tr.sims), L - 1)))


# -- online evaluation ---------------------------------------------------------------------------------

def online(model: RiverModel, ref: dict, policy_for_step: Callable[[int, int], Policy], batch: int,
           prefill: Policy | None = None) -> dict:
    """Teacher-forced decoding of the backbone's tokens (all of ref's, Settings.online_tokens per prompt)
    with a policy that writes its own KV cache, so river-written K/V feed every later token as at run time.
    policy_for_step(step, batch size) gives each step's policy; KL/agreement against the backbone.

    What online_stepwise() computes one step at a time, each prompt's decode tokens in one pass (parallel.py);
    the policies are drawn in the same order (batches of `batch` prompts, step by step), so a random policy
    draws the same exits."""
    kls, agrees, depths, at = [], [], [], []
    items = list(ref.values())
    for b0 in range(0, len(items), batch):
        chunk = items[b0:b0 + batch]
        caches = prefilled(model, chunk, prefill or policy_for_step(-1, len(chunk)))
        steps = [policy_for_step(i, len(chunk)) for i in range(len(chunk[0][1]))]
        for b, ((_, t, lp), c) in enumerate(zip(chunk, caches)):
            own = [p if p.forced is None or isinstance(p.forced, int) else replace(p, forced=p.forced[b])
                   for p in steps[:len(t)]]
            lg, exits = decode_pass(model, c, t, own)
            kls.append(kl_div(lp[:len(t)], lg))
            agrees.append((lg.argmax(-1) == lp[:len(t)].argmax(-1)).float())
            depths.append(torch.tensor(exits, dtype=torch.float32) + 1)
            at.append(torch.arange(len(t)))
    return _online_summary(kls, agrees, depths, at, items)


def online_stepwise(model: RiverModel, ref: dict, policy_for_step: Callable[[int, int], Policy], batch: int,
                    prefill: Policy | None = None) -> dict:
    """online(), one RiverModel.step per decode token (the reference its one-pass decode is tested against)."""
    kls, agrees, depths, at = [], [], [], []
    items = list(ref.values())
    for b0 in range(0, len(items), batch):
        chunk = items[b0:b0 + batch]
        caches = prefilled(model, chunk, prefill or policy_for_step(-1, len(chunk)))
        for i in range(len(chunk[0][1])):
            st = model.step([([t[i]], c) for (_, t, _), c in zip(chunk, caches)], policy_for_step(i, len(chunk)),
                            per_sequence=True)
            lg = torch.cat(st.logits)
            ref_lp = torch.stack([lp[i] for _, _, lp in chunk])
            kls.append(kl_div(ref_lp, lg))
            at.append(torch.full((len(chunk),), i))
            agrees.append((lg.argmax(-1) == ref_lp.argmax(-1)).float())
            depths.append(torch.tensor(st.exit_layer, dtype=torch.float32) + 1)
    return _online_summary(kls, agrees, depths, at, items)


def _online_summary(kls, agrees, depths, at, items) -> dict:
    cat = lambda xs: float(torch.cat(xs).mean())
    n = min(len(t) for _, t, _ in items)
    kl, at = torch.cat(kls), torch.cat(at)
    # does river-written K/V make later tokens worse? mean KL per quarter of the positions
    quarters = [float(kl[(at * 4 // n) == q].mean()) for q in range(4)] if n >= 4 else []
    return {"depth": cat(depths), "kl": cat(kls), "agreement": cat(agrees), "tokens_per_prompt": n,
            "kl_quarters": quarters}


def rule_policy(tau, m) -> Callable[[int, int], Policy]:
    return lambda i, n: Policy(thresholds=[float(x) for x in tau], min_exit_layer=m)


def random_policy(p_backbone: float, L: int, seed: int) -> Callable[[int, int], Policy]:
    """Each token all-backbone with probability p, else all-river: random selection at a given depth."""
    rng = random.Random(seed)
    return lambda i, n: Policy(forced=[L - 1 if rng.random() < p_backbone else -1 for _ in range(n)])


# -- correlation of signals with damage ----------------------------------------------------------------

def spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def signal_quality(tr: Trace) -> dict:
    """Per layer, Spearman of each signal with the KL of exiting there. A good exit signal says 'safe'
    where damage is low: high cosine should mean low KL (negative rho), high entropy high KL (positive)."""
    L = tr.sims.shape[1]
    out = {}
    for name, sig in (("cosine", tr.sims), ("cosine_no_massive", tr.sims_nomassive), ("river_entropy", tr.entropy)):
        out[name] = [spearman(sig[:, l], tr.kl[:, l]) for l in range(L - 1)]
    return out


# Relative cost per prompt of its backbone decode, recording its signals, one online check of the rule, one of the
# gated mode (SmolLM2, AMD Zen 4, 2 cores, a build's OUT.calibration.json "seconds": 3.1 s, 1.9 s, 1.1 s, 2.4 s):
# the progress bar's units.
W_DECODE, W_RECORD, W_RULE, W_GATE = 3, 2, 1, 2


# -- the whole calibration -----------------------------------------------------------------------------

def calibrate(model: RiverModel, prompts: list[list[int]], target: Target, s: Settings,
              progress: Callable[[str, int, int], None] = lambda what, done, total: None,
              keep: dict | None = None, seconds: dict | None = None, gate_to_come: bool = False) -> dict:
    """Fit on half of the prompts (shuffled), report on the other half. Returns the fit summary; `keep` (a dict)
    receives the recordings of both halves ("fit", "test": record()'s aux) for the gate's fit; `seconds` (a dict)
    each step's wall time. gate_to_come: the caller fits the gate next (report.calibrate_file): the progress total
    includes its checks, keep["tick"] counts them, and the caller reports the end."""
    if len(prompts) < 2:
        raise RiverError("calibration needs at least 2 prompts")
    if model.river is None:
        raise RiverError("this GGUF has no river tensors: build one with `river build`")
    L = model.args.n_layer
    rng = random.Random(s.seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    half = len(order) // 2
    fit_p, test_p = [prompts[i] for i in order[:half]], [prompts[i] for i in order[half:]]
    # progress in units of work, so that the bar's estimate of what is left holds across steps of unequal cost
    total = (W_DECODE + W_RECORD) * len(prompts) + W_RULE * 3 * len(prompts) + (W_GATE * (3 * len(fit_p) + len(test_p))
                                                                   if gate_to_come else 0)
    done = [0]

    def tick(what, w=1):
        def f(n):
            done[0] += n * w
            progress(what, done[0], total)
        return f

    took = seconds if seconds is not None else {}
    clock = [time.monotonic()]

    def lap(step):
        now = time.monotonic()
        took[step] = round(took.get(step, 0.0) + now - clock[0], 2)
        clock[0] = now

    progress("decoding the prompts", 0, total)  # the first tick comes only after a whole batch
    decoded = decode(model, fit_p + test_p, s, tick("decoding the prompts", W_DECODE))   # both halves in lockstep
    lap("backbone_decode")
    tr_fit, aux = record(model, fit_p, s, tick("recording signals (fit prompts)", W_RECORD),
                         decoded=decoded[:half])
    lap("record_fit_prompts")
    tr_test, aux_test = record(model, test_p, s, tick("recording signals (test prompts)", W_RECORD),
                               massive=aux["massive"], decoded=decoded[half:])
    lap("record_test_prompts")
    del decoded
    if keep is not None:
        keep.update(fit=aux, test=aux_test)

    # Fit on clean figures, then tighten until the rule meets the target online on the fit prompts.
    inflation, chosen, measured, checks = 1.0, None, None, 0
    for _ in range(3):
        checks += 1
        chosen = fit(tr_fit, target, s.rule, inflation)
        measured = online(model, aux["ref"], rule_policy(chosen["thresholds"], chosen["min_exit_layer"]), s.batch)
        tick("checking the fit online")(len(fit_p))
        lap("online_fit_checks")
        if target.met(measured):
            break
        c = chosen["clean"]
        ratio = {"kl": measured["kl"] / max(c["kl"], 1e-9),
                 "agreement": (1 - measured["agreement"]) / max(1 - c["agreement"], 1e-9),
                 "depth": measured["depth"] / max(c["depth"], 1e-9)}[target.kind]
        inflation = max(inflation * 1.25, ratio)  # the measured clean-to-online inflation
    tick("checking the fit online")(len(fit_p) * (3 - checks))   # the checks it did not need
    if not target.met(measured) and target.kind != "depth":   # the backbone always meets a quality target
        chosen = backbone_fit(tr_fit)   # (a depth target keeps its shallowest try; the verdict says how far off)

    tau, m = chosen["thresholds"], chosen["min_exit_layer"]
    test_rule = online(model, aux_test["ref"], rule_policy(tau, m), s.batch)
    tick("evaluating on test prompts")(len(test_p))
    lap("online_test_rule")
    p_bb = test_rule["depth"] / L
    test_random = online(model, aux_test["ref"], random_policy(p_bb, L, s.seed), s.batch,
                         prefill=Policy.backbone())
    tick("evaluating on test prompts")(len(test_p))
    lap("online_test_random")
    test_river = online(model, aux_test["ref"], lambda i, n: Policy(forced=-1), s.batch)
    tick("evaluating on test prompts")(len(test_p))
    lap("online_test_all_river")
    quality = signal_quality(tr_test)
    sweep = []
    for tau_c, m_c, q in candidates(tr_test, s.rule, [m]):
        sweep.append(dict(quantile=q, **predict(tr_test, exits_of(tr_test.sims, tau_c, m_c))))
    # NaN where no layer has a correlation (one layer; constant damage): numpy would warn on the empty median
    median = {k: float(np.nanmedian(v)) if np.isfinite(np.asarray(v, dtype=float)).any() else math.nan
              for k, v in quality.items()}
    # the least threshold exits at the min exit layer whatever the similarity: one exit layer for every
    # token, so "random tokens at the same depth" is the same configuration, not a comparison
    degenerate = m < L - 1 and bool(np.all(np.asarray(tau[m:L - 1]) <= 0.0))
    lap("sweep_and_signal_quality")
    if gate_to_come and keep is not None:
        keep["tick"], keep["total"] = tick, total
    else:
        progress("done", total, total)
    return {
        "target": asdict(target),
        "rule": s.rule,
        "thresholds": [float(x) for x in tau],
        "min_exit_layer": int(m),
        "quantile": chosen["quantile"],
        "settings": s.recorded(),
        "n_fit_prompts": len(fit_p), "n_test_prompts": len(test_p),
        "massive_dims": aux["massive"],
        "fit_online": measured,
        "fit_online_checks": checks,
        "test": {"rule": test_rule, "random_same_depth": test_random, "all_river": test_river,
                 "backbone": {"depth": float(L), "kl": 0.0, "agreement": 1.0}},
        "test_clean_sweep": sweep,
        "spearman_per_layer": quality,
        "spearman_median": median,
        "degenerate": degenerate,
        "target_met_on_test": target.met(test_rule),
        "verdict": verdict(median, test_rule, test_random, degenerate, target, int(m), L),
    }


def verdict(median: dict, rule: dict, rnd: dict, degenerate: bool = False, target: Target | None = None,
            m: int = 0, n_layer: int = 0) -> str:
    rho = median["cosine"]
    words = "barely predicts" if abs(rho) < 0.3 else "weakly predicts" if abs(rho) < 0.5 else "predicts"
    s = (f"the paper's cosine signal {words} the damage of exiting on this model (median Spearman "
         f"{rho:+.2f} per layer; a useful signal would be strongly negative); the river's own entropy: "
         f"{median['river_entropy']:+.2f}.")
    if n_layer == 1:   # no signal to judge: s_l exists for layers 0..L-2 only
        s = "a one-layer model has no layer to exit after: the rule never exits (thresholds +inf)."
    if degenerate:
        s += (f" Degenerate fit: every token exits after layer {m} whatever its similarity (the rule decides "
              "nothing; random selection at that depth is the same configuration).")
    elif rule["depth"] <= rnd["depth"] * 1.02 + 0.1 and rule["kl"] != rnd["kl"]:
        # random is drawn at the rule's depth; a small excess depth (sampling noise) still counts as "same"
        better = "random token selection" if rnd["kl"] < rule["kl"] else "the rule"
        s += (f" At the same depth {better} does better (KL {min(rnd['kl'], rule['kl']):.4f} vs "
              f"{max(rnd['kl'], rule['kl']):.4f}).")
    if target is not None and not target.met(rule):
        got = rule[target.kind]
        at = f" over {rule['tokens_per_prompt']} generated tokens" if "tokens_per_prompt" in rule else ""
        s += (f" The target {target.kind} {'<=' if target.kind != 'agreement' else '>='} {target.value:g} is not met "
              f"on unseen prompts{at}: {got:.4g}, {abs(got - target.value):.2g} off.")
    return s
