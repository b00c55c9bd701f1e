"""Fitting the gated mode's gate (river_edge/spec.py): the river's output entropy above which the backbone
re-decodes a token, to a quality target; stored in the GGUF as river.gate_entropy.

Recording reuses calibrate's machinery: greedy backbone decoding in the reference model, and for every
decode token the all-river logits computed "clean" (the river attending to the backbone's cache for earlier
positions, calibrate._clean_exits with exit layer -1). Per token: KL(backbone || river), top-1 agreement,
the river's entropy and its top-1 margin. A token whose signal crosses the gate falls back to the backbone
(KL 0, agreement 1), so the fit is a sort. The report compares with random fallback at the same rate,
whose expected KL is (1 - rate) * mean KL. Clean figures: online, river-written K/V of the tokens that did
not fall back also pollute later ones (docs/design.md §5 item 6: about 2x).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from . import format as F
from .calibrate import Settings, Target, _clean_exits, _decode_backbone, _entropy, _kl, default_prompts
from .format import RiverError


def record_gate(model, prompts: list[list[int]], s: Settings) -> dict[str, np.ndarray]:
    parts = {k: [] for k in ("kl", "agree", "entropy", "margin")}
    with torch.no_grad():
        for b0 in range(0, len(prompts), s.batch):
            batch = prompts[b0:b0 + s.batch]
            caches, toks, hid, logits, pos = _decode_backbone(model, batch, s.decode_tokens)
            logp = torch.log_softmax(logits, -1)
            (_, lg), = list(_clean_exits(model, caches, hid, pos, [-1]))
            top2 = torch.softmax(lg, -1).topk(2, -1).values
            parts["kl"].append(_kl(logp, lg).flatten())
            parts["agree"].append((lg.argmax(-1) == logits.argmax(-1)).float().flatten())
            parts["entropy"].append(_entropy(lg).flatten())
            parts["margin"].append((top2[..., 0] - top2[..., 1]).flatten())
    return {k: torch.cat(v).numpy().astype(np.float64) for k, v in parts.items()}


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


def write_gate(src: str | Path, dst: str | Path, gate: float, summary: dict | None = None) -> Path:
    """Copy `src` to `dst` with river.gate_entropy (and river.gate_summary) set."""
    from gguf import GGUFValueType as V

    from .gguf_tools.build import _Tensor, _arch, _kv, _write
    from .gguf_tools.reader import ggml_shape, open_gguf

    src, dst = Path(src), Path(dst)
    r = open_gguf(src)
    arch, _ = _arch(r, src)
    if F.KEY_VERSION not in r.fields:
        raise RiverError(f"{src}: not a river GGUF; run river build first")
    new = {F.KEY_GATE: (float(gate), V.FLOAT32, None)}
    if summary is not None:
        new[F.KEY_GATE_SUMMARY] = (json.dumps(summary), V.STRING, None)
    kv = [(k, *new.pop(k)) if k in new else (k, v, t, s) for k, v, t, s in _kv(r, skip={"general.architecture"})]
    kv += [(k, *x) for k, x in new.items()]
    tensors = [_Tensor(t.name, ggml_shape(t), t.tensor_type, lambda t=t: t.data) for t in r.tensors]
    tmp = dst.with_name(dst.name + ".tmp")
    _write(tmp, arch, kv, tensors, None)
    tmp.replace(dst)
    return dst


def gate_target(target: Target) -> Target:
    """The gate fits a KL or agreement target; a depth target (the rule's) gives way to the default KL."""
    return target if target.kind in ("kl", "agreement") else Target("kl", 0.05)  # defaults.DEFAULT_TARGET


def calibrate_gate(src: str | Path, dst: str | Path, target: Target, s: Settings = Settings()) -> dict:
    """Record on the packaged prompts, fit on one half, report on the other, write the gate to `dst`."""
    from .reference import RiverModel
    from .tokenizer import Tokenizer

    model = RiverModel(src, emulate=False)
    tok = Tokenizer(src)
    texts = list(s.prompts or default_prompts())
    random.Random(s.seed).shuffle(texts)
    summary = gate_report(model, [tok.chat(t) for t in texts[: s.n_prompts]], target, s)
    write_gate(src, dst, summary["gate_entropy"], compact(summary))
    Path(f"{dst}.gate.json").write_text(json.dumps(summary, indent=1))
    return summary


def compact(summary: dict) -> dict:
    return {k: summary[k] for k in ("target", "gate_entropy", "test")}


def gate_report(model, prompts: list[list[int]], target: Target, s: Settings) -> dict:
    """Fit the gate on the first half of the prompts and report it on the second."""
    half = len(prompts) // 2
    fit_rec, test_rec = record_gate(model, prompts[:half], s), record_gate(model, prompts[half:], s)
    gate = fit_gate(fit_rec, target)
    summary = {"target": {"kind": target.kind, "value": target.value}, "gate_entropy": gate,
               "fit": gate_metrics(fit_rec, gate), "test": gate_metrics(test_rec, gate),
               "test_all_river": {"kl": float(test_rec["kl"].mean()), "agreement": float(test_rec["agree"].mean())},
               "spearman_entropy_kl": _spearman(test_rec["entropy"], test_rec["kl"]),
               "spearman_margin_kl": _spearman(-test_rec["margin"], test_rec["kl"]),
               "test_sweep": sweep(test_rec)}
    return summary


def _spearman(x, y) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])
