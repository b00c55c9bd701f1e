"""A river GGUF calibrated into a new file: the rule and the gate fitted, the keys written, the summary table,
DST.calibration.json and DST.calibration.png."""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Callable

from ..format import RiverError
from ..gguf_tools.build import set_river_keys
from ..gguf_tools.inspect import check
from ..gguf_tools.reader import open_gguf, value
from ..gguf_tools.writer import check_not_input, replacing_together
from ..host import cpu
from ..reference import RiverModel
from ..tokenizer import Tokenizer
from . import figure
from .gate import compact as gate_compact, gate_line, gate_report, gate_target
from .prompts import default_prompts
from .rule import W_GATE, calibrate
from .target import MAX_TOKENS, Settings, Target


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
    if not all(math.isnan(v) for v in med.values()):   # a one-layer model has no exit to correlate
        out.append("median Spearman with the damage, per layer: " +
                   ", ".join(f"{k.replace('_', ' ')} {v:+.2f}" for k, v in med.items()))
    out.append("verdict: " + s["verdict"])
    if g := s.get("gate"):
        out.append(gate_line(g))
    return "\n".join(out)


def prompt_tokens(src: str | Path, s: Settings) -> list[list[int]]:
    """The run's prompts as chat token ids: the first n_prompts of the settings' (else the packaged set's), shuffled.

    One too long for the model's context (with the tokens decoded after it) or for the calibration (MAX_TOKENS:
    its torch prefill holds heads x n^2 attention scores) is refused, not cut: calibration fits the thresholds to
    the prompts it is given, a cut one (its question often at the end) is a text nobody sends, and the user knows
    which to shorten."""
    r = open_gguf(src)
    ctx = value(r, f"{value(r, 'general.architecture')}.context_length")
    ctx = ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None
    n_gen = max(s.decode_tokens, s.online_tokens)   # the backbone decodes this far after each prompt
    tok = Tokenizer(src)
    texts = s.prompts or default_prompts()
    random.Random(s.seed).shuffle(texts := list(texts))
    out = []
    for t in texts[: s.n_prompts]:
        ids = tok.chat(t)
        where = getattr(t, "where", "") or f"prompt {t[:40]!r}"   # read_prompts' FILE:LINE
        if len(ids) > MAX_TOKENS:
            raise RiverError(f"{where}: a prompt of {len(ids):,} tokens; calibration takes at most {MAX_TOKENS:,}")
        if ctx is not None and len(ids) + n_gen > ctx:
            raise RiverError(f"{where}: a prompt of {len(ids):,} tokens, with the {n_gen:,} decoded after it, passes "
                             f"the model's context of {ctx:,} tokens")
        out.append(ids)
    return out


def check_target(src: str | Path, target: Target) -> None:
    """A depth target at or past the model's layer count is met by the backbone alone: refused, where a fit would
    quietly write thresholds that never exit."""
    r = open_gguf(src)
    n = value(r, f"{value(r, 'general.architecture')}.block_count")
    if target.kind == "depth" and isinstance(n, int) and target.value >= n:
        raise RiverError(f"a depth target of {target.value:g} layers is not below the model's {n}: every token would "
                         f"run the whole backbone and the river never exit; give a depth below {n}")


def calibrate_file(src: str | Path, dst: str | Path, target: Target, s: Settings = Settings(),
                   progress: Callable[[str, int, int], None] = lambda what, done, total: None,
                   label: str | None = None, prompts: list[list[int]] | None = None,
                   seconds: dict | None = None) -> dict:
    """Fit thresholds for the river GGUF `src` and write them to `dst` (never `src`), with the report
    beside it: DST.calibration.json and DST.calibration.png. `label` names the model in the summary and
    the plot (default: src's file name; a build through a temporary file passes the final name). `prompts`:
    prompt_tokens(), when the caller checked them and the target (check_target) already. `seconds`: steps the caller
    timed before (the build), recorded first in the summary's "seconds" with each step here. The three files appear
    together or not at all."""
    src, dst = Path(src), Path(dst)
    check_not_input(src, dst)
    check(src, require_river=True)
    if prompts is None:   # else the caller checked them and the target (defaults.build_calibrated_river)
        check_target(src, target)
        prompts = prompt_tokens(src, s)   # before the model: a bad prompt fails at once
    took, t0 = dict(seconds or {}), time.monotonic()
    progress("loading the model", 0, 1)
    model = RiverModel(src, emulate=False)  # the exact math; ggml's rounding only matters at 1e-3
    took["load_model"] = round(time.monotonic() - t0, 2)
    rec: dict = {}
    summary = calibrate(model, prompts, target, s, progress, keep=rec, seconds=took, gate_to_come=True)
    summary["source"] = label = label or src.name
    # the gated mode's gate, from the same recordings and split (a depth target: the default KL)
    t0 = time.monotonic()
    gate = gate_report(model, rec["fit"], rec["test"], gate_target(target), s,
                       rec["tick"]("fitting and checking the gated mode's gate", W_GATE))
    summary["gate"] = gate_compact(gate)
    progress("done", rec["total"], rec["total"])
    took["gate_fit_and_checks"] = round(time.monotonic() - t0, 2)
    summary["host"] = cpu()
    summary["seconds"] = took   # the last step, writing these files, is not in it
    # the reports first, the GGUF last: a reader that finds the GGUF finds its reports
    with replacing_together([f"{dst}.calibration.json", f"{dst}.calibration.png", dst]) as (js, png, gguf):
        js.write_text(json.dumps(summary, indent=1), encoding="utf-8")
        figure.calibration(summary, png, f"{label}: calibration, {target.kind} <= {target.value}"
               if target.kind != "agreement" else f"{label}: calibration, agreement >= {target.value}")
        set_river_keys(src, gguf, thresholds=summary["thresholds"], min_exit_layer=summary["min_exit_layer"],
                       calibrated=True, fit_summary=json.dumps(_compact(summary)),
                       gate_entropy=gate["gate_entropy"], gate_summary=json.dumps(summary["gate"]))
    return summary


def _compact(s: dict) -> dict:
    """What goes into the GGUF: the fit and its test figures, without the per-layer arrays and sweep."""
    keep = ("target", "rule", "min_exit_layer", "quantile", "settings", "n_fit_prompts", "n_test_prompts",
            "massive_dims", "fit_online", "test", "spearman_median", "verdict", "source")
    return {k: s[k] for k in keep if k in s}
