"""Calibration: record the exit signals and the damage of exiting, fit thresholds, report honestly.

On calibration prompts the backbone decodes greedily; for every decode token and every layer l we record
the paper's signal s_l = cos(h_l, h_l+1) (also without the few massive-activation dimensions), and what
exiting after l costs: the KL of the next-token distribution against the backbone and top-1 agreement,
with the river attending to the backbone's cache ("clean", cheap, all layers at once). Thresholds are fitted
on that, then checked "online": the rule decodes with its own mixed KV cache, so errors accumulate as at
run time, and the fit is tightened until it meets the target online. The report, on prompts the fit did not
see, sets the fitted rule beside random token selection at the same depth and beside all-river.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from .format import RiverError
from .reference import Cache, Policy, RiverModel
from .reference.llama import rms_norm


@dataclass
class Target:
    """What the fit must meet on average over decode tokens: kl (max mean KL), agreement (min top-1
    agreement with the backbone) or depth (max mean backbone layers per token: a speed target)."""
    kind: str
    value: float

    def __post_init__(self):
        if self.kind not in ("kl", "agreement", "depth"):
            raise RiverError(f"unknown calibration target {self.kind!r}: use kl, agreement or depth")
        if not math.isfinite(self.value) or self.value < 0 or (self.kind == "agreement" and self.value > 1):
            raise RiverError(f"calibration target {self.kind}={self.value} is out of range")

    def met(self, m: dict) -> bool:
        return {"kl": m["kl"] <= self.value, "agreement": m["agreement"] >= self.value,
                "depth": m["depth"] <= self.value}[self.kind]


@dataclass
class Settings:
    n_prompts: int = 16           # split into fit and test halves
    decode_tokens: int = 32       # tokens per prompt whose exit signals and damage are recorded (the fit)
    online_tokens: int = 256      # tokens per prompt of the online checks: the lengths users generate
    batch: int = 8                # prompts decoded in lockstep (each exits on its own)
    rule: str = "per-layer"       # per-layer quantile thresholds, or "single" tau
    seed: int = 0
    prompts: list[str] = field(default_factory=list)  # empty: the packaged calibration set


def default_prompts() -> list[str]:
    text = resources.files("river_edge").joinpath("data/calibration.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def read_prompts(path: str | Path) -> list[str]:
    """Calibration prompts from a file: JSON lines with a "prompt" field (.jsonl, or a first line that
    is a JSON object), else plain text with one prompt per line. Blank lines are skipped."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RiverError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise RiverError(f"{path}: not a UTF-8 text file") from None
    except OSError as e:
        raise RiverError(f"{path}: cannot read ({e.strerror or e})") from None
    lines = [(i, ln.strip()) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    if not lines:
        raise RiverError(f"{path}: no prompts in it")
    if path.suffix != ".jsonl" and not lines[0][1].startswith("{"):
        return [ln for _, ln in lines]
    out = []
    for i, ln in lines:
        try:
            prompt = json.loads(ln)["prompt"]
        except (ValueError, KeyError, TypeError):
            raise RiverError(f"{path}:{i}: not a JSON object with a \"prompt\" field") from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise RiverError(f"{path}:{i}: \"prompt\" is not a non-empty string")
        out.append(prompt)
    return out


# -- recording ----------------------------------------------------------------------------------------

@dataclass
class Trace:
    """Per decode token (rows) and layer (columns); the column L-1 of the damage is exact zero."""
    sims: np.ndarray          # s_l
    sims_nomassive: np.ndarray
    kl: np.ndarray            # clean KL(backbone || exit after l)
    agree: np.ndarray         # clean top-1 agreement of exit after l
    entropy: np.ndarray       # entropy of the exit-after-l distribution (the river's own uncertainty)
    prompt_of: np.ndarray     # prompt index of every row


def _kl(logp_ref: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    logq = torch.log_softmax(logits, -1)
    return (logp_ref.exp() * (logp_ref - logq)).sum(-1).clamp_min(0)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, -1)
    return -(lp.exp() * lp).sum(-1)


def _decode_backbone(model: RiverModel, prompts: list[list[int]], n: int):
    """Greedy backbone decoding in lockstep: caches, decoded tokens, and per step h_0..h_L and logits."""
    size = max(map(len, prompts)) + n + 1  # one size: _clean_exits stacks the caches
    caches = [model.new_cache(size) for _ in prompts]
    st = model.step(list(zip(prompts, caches)), Policy.backbone(), per_sequence=True)
    last = torch.stack([lg[-1] for lg in st.logits])
    toks, hid, logits, pos = [], [], [], []
    for _ in range(n):
        nxt = last.argmax(-1).tolist()
        pos.append([c.n for c in caches])
        st = model.step([([t], c) for t, c in zip(nxt, caches)], Policy.backbone(), per_sequence=True,
                        keep_hidden=True)
        toks.append(nxt)
        hid.append(st.hidden)                       # [L+1, B, d]
        last = torch.cat(st.logits)
        logits.append(last)
    return caches, toks, torch.stack(hid, 2), torch.stack(logits, 1), torch.tensor(pos).T


def _clean_exits(model: RiverModel, caches: list[Cache], hid: torch.Tensor, pos: torch.Tensor, layers):
    """Logits of exiting after each l in `layers` for every decode row, the river attending to the
    backbone's cache for earlier positions and to its own K/V at the token's position."""
    a, L = model.args, model.args.n_layer
    B, T = pos.shape
    rep, scale = a.n_head // a.n_head_kv, a.head_dim ** -0.5
    S = int(pos.max()) + 1
    past = torch.arange(S)[None, None, None, :] < pos[:, None, None, :, None]   # [B, 1, 1, T, S]: s < p
    for e in layers:
        h = hid[e + 1].reshape(B * T, -1).clone()
        for il in range(e + 1, L):
            def attend(q, k, v, il=il):
                q = q.view(B, T, a.n_head_kv, rep, a.head_dim)
                k, v = k.view(B, T, a.n_head_kv, 1, a.head_dim), v.view(B, T, a.n_head_kv, 1, a.head_dim)
                K = torch.stack([c.k[il, :S] for c in caches])                      # [B, S, G, D]
                V = torch.stack([c.v[il, :S] for c in caches])
                s = torch.einsum("btgrd,bsgd->bgrts", q, K) * scale
                s = s.masked_fill(~past, float("-inf"))
                own = torch.einsum("btgrd,btgrd->bgrt", q, k.expand_as(q))[..., None] * scale
                pr = torch.softmax(torch.cat([s, own], -1), -1)
                o = torch.einsum("bgrts,bsgd->btgrd", pr[..., :S], V) + pr[..., S].permute(0, 3, 1, 2)[..., None] * v
                return o.reshape(B * T, a.n_head, a.head_dim)
            h = model.river[il](h, pos.reshape(-1), attend)
        yield e, model.head(rms_norm(h, model.out_norm, a.eps)).reshape(B, T, -1)


def massive_dims(hid: torch.Tensor, k: int = 4, ratio: float = 20.0) -> list[int]:
    """The few dimensions whose mean |h| dwarfs the median one in some layer (SmolLM2: 17, Qwen2.5: 490)."""
    m = hid[1:].abs().flatten(1, -2).mean(1)                     # [L, d]
    r = (m / m.median(-1, keepdim=True).values).amax(0)          # worst ratio over layers, per dim
    top = torch.topk(r, k)
    return sorted(int(i) for v, i in zip(top.values, top.indices) if v > ratio)


def record(model: RiverModel, prompts: list[list[int]], s: Settings, tick: Callable[[int], None] = lambda n: None,
           massive: list[int] | None = None) -> tuple[Trace, dict]:
    L = model.args.n_layer
    parts, ref = [], {}
    for b0 in range(0, len(prompts), s.batch):
        batch = prompts[b0:b0 + s.batch]
        # the backbone decodes as far as the online checks go; the fit records the first decode_tokens
        T = s.decode_tokens
        caches, toks, hid, logits, pos = _decode_backbone(model, batch, max(T, s.online_tokens))
        logp = torch.log_softmax(logits, -1)                       # [B, n, V]: the online reference
        hid, logits, pos = hid[:, :, :T], logits[:, :T], pos[:, :T]
        if massive is None:
            massive = massive_dims(hid)
        top = logits.argmax(-1)
        exits = _clean_exits(model, caches, hid, pos, range(L - 1))
        kl = torch.zeros(len(batch), T, L)
        agree = torch.ones_like(kl)
        ent = torch.zeros_like(kl)
        ent[..., L - 1] = _entropy(logits)
        for e, lg in exits:
            kl[..., e], agree[..., e], ent[..., e] = _kl(logp[:, :T], lg), (lg.argmax(-1) == top).float(), _entropy(lg)
        h0, h1 = hid[:-1], hid[1:]                                 # [L, B, T, d]
        cos = torch.nn.functional.cosine_similarity(h0, h1, dim=-1).permute(1, 2, 0)
        keep = torch.ones(hid.shape[-1], dtype=torch.bool)
        keep[massive] = False
        cosm = torch.nn.functional.cosine_similarity(h0[..., keep], h1[..., keep], dim=-1).permute(1, 2, 0)
        idx = torch.arange(b0, b0 + len(batch))[:, None].expand(-1, T)
        parts.append([cos, cosm, kl, agree, ent, idx])
        for i, p in enumerate(batch):
            ref[b0 + i] = (p, [t[i] for t in toks], logp[i])
        tick(len(batch))
    cat = [torch.cat([p[j] for p in parts]).reshape(-1, *parts[0][j].shape[2:]).numpy() for j in range(6)]
    return Trace(*cat[:5], prompt_of=cat[5]), {"massive": massive, "ref": ref}


# -- the rule on recorded signals ----------------------------------------------------------------------

def exits_of(sims: np.ndarray, tau: np.ndarray, m: int) -> np.ndarray:
    """Exit layer of every row under the rule (first l in [m, L-2] with s_l > tau_l, else L-1)."""
    L = sims.shape[1]
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
        for q in qs:
            if rule == "per-layer":
                tau = np.quantile(tr.sims, q, axis=0)
            else:
                tau = np.full(L, np.quantile(tr.sims[:, m:L - 1], q))
            tau = tau.astype(np.float32)
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
    best = None
    for tau, m, q in candidates(tr, rule, range(1, L - 1)):
        p = predict(tr, exits_of(tr.sims, tau, m))
        online = dict(p, kl=p["kl"] * inflation, agreement=1 - (1 - p["agreement"]) * inflation)
        if not target.met(online):
            continue
        key = (p["kl"], p["depth"]) if target.kind == "depth" else (p["depth"], p["kl"])
        if best is None or key < best[0]:
            best = (key, dict(thresholds=tau, min_exit_layer=m, quantile=q, clean=p))
    if best is None:  # only the backbone meets it
        return dict(thresholds=np.full(L, np.inf, np.float32), min_exit_layer=1, quantile=1.0,
                    clean=predict(tr, np.full(len(tr.sims), L - 1)))
    return best[1]


# -- online evaluation ---------------------------------------------------------------------------------

def online(model: RiverModel, ref: dict, policy_for_step: Callable[[int, int], Policy], batch: int,
           prefill: Policy | None = None) -> dict:
    """Teacher-forced decoding of the backbone's tokens (all of ref's, Settings.online_tokens per prompt)
    with a policy that writes its own KV cache, so river-written K/V feed every later token as at run time.
    policy_for_step(step, batch size) gives each step's policy; KL/agreement against the backbone."""
    kls, agrees, depths, at = [], [], [], []
    items = list(ref.values())
    L = model.args.n_layer
    for b0 in range(0, len(items), batch):
        chunk = items[b0:b0 + batch]
        caches = [model.new_cache(len(p) + len(t) + 1) for p, t, _ in chunk]
        model.step([(p, c) for (p, _, _), c in zip(chunk, caches)], prefill or policy_for_step(-1, len(chunk)),
                   per_sequence=True)
        for i in range(len(chunk[0][1])):
            st = model.step([([t[i]], c) for (_, t, _), c in zip(chunk, caches)], policy_for_step(i, len(chunk)),
                            per_sequence=True)
            lg = torch.cat(st.logits)
            ref_lp = torch.stack([lp[i] for _, _, lp in chunk])
            kls.append(_kl(ref_lp, lg))
            at.append(torch.full((len(chunk),), i))
            agrees.append((lg.argmax(-1) == ref_lp.argmax(-1)).float())
            depths.append(torch.tensor(st.exit_layer, dtype=torch.float32) + 1)
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


# -- the whole calibration -----------------------------------------------------------------------------

def calibrate(model: RiverModel, prompts: list[list[int]], target: Target, s: Settings,
              progress: Callable[[str, int, int], None] = lambda what, done, total: None) -> dict:
    """Fit on the first half of the prompts, report on the second. Returns the fit summary."""
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
    total = len(prompts) + 3 * len(test_p) + 3 * len(fit_p)
    done = [0]

    def tick(what):
        def f(n):
            done[0] += n
            progress(what, done[0], total)
        return f

    progress("recording signals (fit prompts)", 0, total)  # the first tick comes only after a whole batch
    tr_fit, aux = record(model, fit_p, s, tick("recording signals (fit prompts)"))
    tr_test, aux_test = record(model, test_p, s, tick("recording signals (test prompts)"), massive=aux["massive"])

    # Fit on clean figures, then tighten until the rule meets the target online on the fit prompts.
    inflation, chosen, measured = 1.0, None, None
    for _ in range(3):
        chosen = fit(tr_fit, target, s.rule, inflation)
        measured = online(model, aux["ref"], rule_policy(chosen["thresholds"], chosen["min_exit_layer"]), s.batch)
        tick("checking the fit online")(len(fit_p))
        if target.met(measured):
            break
        c = chosen["clean"]
        ratio = (measured["kl"] / max(c["kl"], 1e-9)) if target.kind == "kl" else \
                ((1 - measured["agreement"]) / max(1 - c["agreement"], 1e-9))
        inflation = max(inflation * 1.25, ratio)  # the measured clean-to-online inflation
    if not target.met(measured):  # fall back to the backbone: it always meets a quality target
        chosen = dict(thresholds=np.full(L, np.inf, np.float32), min_exit_layer=1, quantile=1.0,
                      clean=predict(tr_fit, np.full(len(tr_fit.sims), L - 1)))

    tau, m = chosen["thresholds"], chosen["min_exit_layer"]
    test_rule = online(model, aux_test["ref"], rule_policy(tau, m), s.batch)
    tick("evaluating on test prompts")(len(test_p))
    p_bb = test_rule["depth"] / L
    test_random = online(model, aux_test["ref"], random_policy(p_bb, L, s.seed), s.batch,
                         prefill=Policy.backbone())
    tick("evaluating on test prompts")(len(test_p))
    test_river = online(model, aux_test["ref"], lambda i, n: Policy(forced=-1), s.batch)
    tick("evaluating on test prompts")(len(test_p))
    quality = signal_quality(tr_test)
    sweep = []
    for tau_c, m_c, q in candidates(tr_test, s.rule, [m]):
        sweep.append(dict(quantile=q, **predict(tr_test, exits_of(tr_test.sims, tau_c, m_c))))
    median = {k: float(np.nanmedian(v)) for k, v in quality.items()}
    # the least threshold exits at the min exit layer whatever the similarity: one exit layer for every
    # token, so "random tokens at the same depth" is the same configuration, not a comparison
    degenerate = bool(np.all(np.asarray(tau[m:L - 1]) <= 0.0))
    progress("done", total, total)
    return {
        "target": asdict(target),
        "rule": s.rule,
        "thresholds": [float(x) for x in tau],
        "min_exit_layer": int(m),
        "quantile": chosen["quantile"],
        "settings": {k: v for k, v in asdict(s).items() if k != "prompts"},
        "n_fit_prompts": len(fit_p), "n_test_prompts": len(test_p),
        "massive_dims": aux["massive"],
        "fit_online": measured,
        "test": {"rule": test_rule, "random_same_depth": test_random, "all_river": test_river,
                 "backbone": {"depth": float(L), "kl": 0.0, "agreement": 1.0}},
        "test_clean_sweep": sweep,
        "spearman_per_layer": quality,
        "spearman_median": median,
        "degenerate": degenerate,
        "target_met_on_test": target.met(test_rule),
        "verdict": verdict(median, test_rule, test_random, degenerate, target, int(m)),
    }


def verdict(median: dict, rule: dict, rnd: dict, degenerate: bool = False, target: Target | None = None,
            m: int = 0) -> str:
    rho = median["cosine"]
    words = "barely predicts" if abs(rho) < 0.3 else "weakly predicts" if abs(rho) < 0.5 else "predicts"
    s = (f"the paper's cosine signal {words} the damage of exiting on this model (median Spearman "
         f"{rho:+.2f} per layer; a useful signal would be strongly negative); the river's own entropy: "
         f"{median['river_entropy']:+.2f}.")
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


# -- files ---------------------------------------------------------------------------------------------

def format_summary(s: dict) -> str:
    t, L = s["test"], s["test"]["backbone"]["depth"]
    rows = [("rule (fitted)", t["rule"]), ("random, same depth", t["random_same_depth"]),
            ("all-river", t["all_river"]), ("backbone", t["backbone"])]
    out = [f"target {s['target']['kind']} = {s['target']['value']}; rule {s['rule']}, min exit layer "
           f"{s['min_exit_layer']}; fit on {s['n_fit_prompts']} prompts, shown on {s['n_test_prompts']} unseen",
           f"online: {t['rule'].get('tokens_per_prompt', '?')} tokens per prompt, teacher-forced on the backbone's "
           f"greedy text, each policy writing its own K/V",
           f"{'policy':<20}{'depth':>8}{'of':>4}{'KL':>10}{'top-1':>8}"]
    out += [f"{n:<20}{m['depth']:>8.2f}{int(L):>4}{m['kl']:>10.4f}{m['agreement']:>8.3f}" for n, m in rows]
    if q := t["rule"].get("kl_quarters"):
        out.append("rule's KL by quarter of the generation: " + ", ".join(f"{x:.4f}" for x in q))
    med = s["spearman_median"]
    out.append("median Spearman with the damage, per layer: " +
               ", ".join(f"{k.replace('_', ' ')} {v:+.2f}" for k, v in med.items()))
    out.append("verdict: " + s["verdict"])
    if g := s.get("gate"):
        t = g["test"]
        out.append(f"gated mode: fall back to the backbone at river entropy >= {g['gate_entropy']:.3g} nats: on unseen "
                   f"prompts fallback {t['fallback_rate']:.2f}, KL {t['kl']:.4f}, top-1 {t['agreement']:.3f} "
                   f"(random fallback at that rate: KL {t['random']['kl']:.4f}, top-1 {t['random']['agreement']:.3f})")
    return "\n".join(out)


def calibrate_file(src: str | Path, dst: str | Path, target: Target, s: Settings = Settings(),
                   progress: Callable[[str, int, int], None] = lambda what, done, total: None,
                   label: str | None = None) -> dict:
    """Fit thresholds for the river GGUF `src` and write them to `dst` (never `src`), with the report
    beside it: DST.calibration.json and DST.calibration.png. `label` names the model in the summary and
    the plot (default: src's file name; a build through a temporary file passes the final name)."""
    from .gate import compact as gate_compact, gate_report, gate_target
    from .gguf_tools.build import set_river_keys
    from .gguf_tools.inspect import check
    from .plots import calibration_figure
    from .tokenizer import Tokenizer

    src, dst = Path(src), Path(dst)
    if dst.exists() and dst.resolve() == src.resolve():
        raise RiverError(f"{dst}: calibration never overwrites its input; choose another output")
    check(src, require_river=True)
    progress("loading the model", 0, 1)
    model = RiverModel(src, emulate=False)  # the exact math; ggml's rounding only matters at 1e-3
    tok = Tokenizer(src)
    texts = s.prompts or default_prompts()
    random.Random(s.seed).shuffle(texts := list(texts))
    prompts = [tok.chat(t) for t in texts[: s.n_prompts]]
    summary = calibrate(model, prompts, target, s, progress)
    summary["source"] = label = label or src.name
    # the gated mode's gate, on the same prompts and target (a depth target: the default KL)
    progress("fitting the gated mode's gate", 0, 1)
    gate = gate_report(model, prompts, gate_target(target), s)
    summary["gate"] = gate_compact(gate)
    progress("fitting the gated mode's gate", 1, 1)
    set_river_keys(src, dst, thresholds=summary["thresholds"], min_exit_layer=summary["min_exit_layer"],
                   calibrated=True, fit_summary=json.dumps(_compact(summary)), gate_entropy=gate["gate_entropy"],
                   gate_summary=json.dumps(summary["gate"]))
    Path(f"{dst}.calibration.json").write_text(json.dumps(summary, indent=1))
    calibration_figure(summary, f"{dst}.calibration.png", f"{label}: calibration, {target.kind} <= {target.value}"
                       if target.kind != "agreement" else f"{label}: calibration, agreement >= {target.value}")
    return summary


def _compact(s: dict) -> dict:
    """What goes into the GGUF: the fit and its test figures, without the per-layer arrays and sweep."""
    keep = ("target", "rule", "min_exit_layer", "quantile", "settings", "n_fit_prompts", "n_test_prompts",
            "massive_dims", "fit_online", "test", "spearman_median", "verdict", "source")
    return {k: s[k] for k in keep if k in s}
