"""The results pages, written from the benchmark JSON alone (bench/steps.py runs the measurements): the
generated section of docs/results.md, its plots, and the README's headline (headline.py), one table per host."""
from __future__ import annotations

import json
import os
from pathlib import Path

from bench import builds as B, figures as P, upcast, vcost
from bench.headline import HEADLINE, headline, paired_ratio
from bench.headtable import HEAD, head_table
from bench.recorded import (GEMMA, QWEN, QWEN15, SMOL, cpu_words, dash, host_line, load_modes, load_record, same_text_note,
                            where)
from bench.recorded import machine, other_hosts

FULL = {"gsm8k": 300, "math": 100, "humaneval": 80}   # accuracy tasks and their full problem counts
EVAL_CONFIGS = ["backbone", "river", "exact", "gated", "fast", "q8_0", "q4_0"]
_builds: dict = {}   # builds.json of the folder being reported (results_section() sets it)


def _built(m: dict | None) -> str:
    """A record's build in words (bench/builds.py): every section names the series it was measured on."""
    return B.words(B.build_of(m or {}), _builds)


def _calibration(c: dict, model: str) -> list[str]:
    t, L = c["test"], c["test"]["backbone"]["depth"]
    rows = [("fitted rule", t["rule"]), ("random tokens, same depth", t["random_same_depth"]),
            ("all-river", t["all_river"]), ("backbone", t["backbone"])]
    med = c["spearman_median"]
    out = [f"**Calibration, {model}** (target mean KL <= {c['target']['value']}, {c['n_fit_prompts']} prompts "
           f"to fit, {c['n_test_prompts']} unseen; online over {t['rule'].get('tokens_per_prompt', 32)} generated tokens "
           f"per prompt, each policy writing its own K/V; {where(c)}, {_built(c)}):", "",
           f"| policy (unseen prompts) | backbone layers per token (of {int(L)}) | mean KL | top-1 agreement |",
           "|---|---|---|---|"]
    out += [f"| {n} | {m['depth']:.2f} | {m['kl']:.4f} | {m['agreement']:.3f} |" for n, m in rows]
    out += ["", "Median Spearman, per layer, between a signal and the damage of exiting there: " +
            ", ".join(f"{k.replace('_', ' ')} {v:+.2f}" for k, v in med.items()) +
            " (a useful exit signal would be strongly negative for the cosine)."]
    if g := c.get("gate"):
        from river_edge.calibration.gate import gate_line
        line = gate_line(g)
        out.append(line[0].upper() + line[1:])
    return out + [""]


def _modes(m: dict) -> list[str]:
    fa = " --flash-attn" if m.get("flash_attn") else ""
    notes = m.get("notes") or {}
    target = m["model"]
    bb = notes.get("backbone_type")
    if bb in ("keep", "q8_0") or notes.get("calibrated") is False:
        # a river built first: over a quantized backbone, or uncalibrated (a model name would calibrate one)
        target = f"{m['model']}.river.gguf"
        fa += (f"` after `river build {notes.get('source_model')} -o {target}"
               + (f" --backbone {bb}" if bb in ("keep", "q8_0") else "") + " --no-calibrate")
    out = [f"**Decoding modes, {m['model']}** (`river bench {target} --mode {','.join(m['configs'])}{fa}`; {m['tokens']} greedy tokens "
           f"x {len(m['prompts'])} chat prompts x {m['rounds']} rounds, configurations alternating in one process"
           + ("" if m.get("settled", True) else
              f", the cap on rounds reached before every interval was within +-{m.get('ci_target', 0.05):.0%}")
           + f"; {host_line(m)}; {_built(m)}):", "",
           "| config | tok/s | x backbone (median, 95% CI) | request x backbone | peak MiB | runs identical to backbone | notes |",
           "|---|---|---|---|---|---|---|"]
    from river_edge.measure.modes import note
    for c, d in m["configs"].items():
        lo, hi = d.get("ratio_ci95") or (d["ratio_min"], d["ratio_max"])
        mem = (d.get("memory") or {}).get("peak_mib")
        out.append(f"| {c} | {d['tok_s_median']:.1f} | {d['ratio_median']:.2f} ({lo:.2f}-{hi:.2f}) | "
                   f"{dash(d.get('request_ratio_median'))} | {dash(mem, '{:.0f}')} | {d['identical_runs']}/{d['runs']} | {note(c, d, m)} |")
    out += ["", same_text_note(m) + (f" That pass: {B.words(s['build'], _builds)}." if (s := m.get("same_text")) else "")]
    ex = m["configs"].get("exact", {}).get("cost_model")
    if ex:
        v = ex["verify_ms_used"]
        out += ["", f"Exact mode's cost model on this host: draft step {ex['draft_ms']:.1f} ms, backbone batch of "
                f"1..{len(v)} tokens " + ", ".join(f"{x:.0f}" for x in v) + " ms. On hardware where a batch of 5 "
                "costs about one step (GPU, Metal, more cores; none measured here) the cost model predicts more from the same acceptance: speed-up = "
                "E(k) / (k draft + verify(k+1)) with E(k) = (1 - a^(k+1)) / (1 - a)."]
        if (c := _ceiling(m)) is not None and c[0]:
            out[-1] += (f" Here, if every draft were accepted, the best cycle (k = {c[0]}: {c[0]} drafts and a batch of "
                        f"{c[0] + 1}) would give {c[1]:.2f}x the backbone's {c[2]:.0f} ms decode step: this drafter's "
                        "ceiling on this host.")
        elif c is not None:
            out[-1] += " Here drafting cannot pay even if every draft were accepted: no usable batch costs little enough."
    return out + [""]


def _ceiling(m: dict) -> tuple[int, float, float] | None:
    """Exact mode's speed-up over the backbone at acceptance 1 from the JSON's own costs: (k, ratio, step ms)."""
    ex, bb = m["configs"]["exact"]["cost_model"], m["configs"].get("backbone", {}).get("tok_s_median")
    if not bb:
        return None
    v, ok, step = ex["verify_ms_used"], ex.get("usable_batch") or [], 1000.0 / bb
    best = max(((k, step * (k + 1) / (k * ex["draft_ms"] + v[k])) for k in range(len(v))
                if k < len(ok) and ok[k] or not ok), key=lambda x: x[1])
    return best[0], best[1], step


def _quality(q: dict, modes: dict | None) -> list[str]:
    L = q["n_layer"]
    # exact mode's row comes from the modes benchmark: only from the same machine (one host a table)
    borrow = bool(modes and "exact" in modes["configs"] and machine(modes.get("host")) == machine(q.get("host")))
    out = [f"**Distribution quality, {q['model']}** (`bench/quality.py`: teacher-forced on {len(q['texts'])} "
           f"held-out texts, {q['positions']} positions, one token per decode as in generation; speed = this run's "
           f"decode tok/s over the backbone's, one configuration after another, not alternating; {where(q)}, "
           f"{_built(q)}" + (f"; the exact row from the modes benchmark, {_built(modes)}"
                             if borrow and _built(modes) != _built(q) else "") + "):", "",
           "| config | mean KL vs backbone | top-1 agreement | perplexity | backbone layers | speed x backbone |",
           "|---|---|---|---|---|---|"]
    for c, d in q["configs"].items():
        depth = f"{d['mean_depth']:.1f}/{L}" if "mean_depth" in d else "-"
        extra = f" (fallback {d['fallback_rate']:.2f})" if "fallback_rate" in d else ""
        if c == q.get("shipped_type"):
            extra = " (the shipped type: next to the shipped weights themselves)"
        out.append(f"| {c}{extra} | {max(d['kl'], 0):.4f} | {d['agreement']:.3f} | {d['perplexity']:.3f} | {depth} | "
                   f"{d['speed_ratio']:.2f} |")
    gates = [(r, c[f"gated@{r}"], c[f"gated-random@{r}"]) for r in (0.1, 0.25, 0.5)
             if f"gated@{r}" in (c := q["configs"]) and f"gated-random@{r}" in c]
    if borrow:
        e = modes["configs"]["exact"]
        out.append(f"| exact (from the modes benchmark) | 0 (the backbone's tokens: {e['identical_runs']}/{e['runs']} "
                   f"runs identical) | 1 | backbone's | {L}/{L} verified | {e['ratio_median']:.2f} |")
    if gates:
        out += ["", "Gated mode against random fallback at the same rate (online, teacher-forced): " + "; ".join(
            f"rate {g['fallback_rate']:.2f}: KL {g['kl']:.4f} vs {gr['kl']:.4f} (random at {gr['fallback_rate']:.2f}), "
            f"top-1 {g['agreement']:.3f} vs {gr['agreement']:.3f}" for r, g, gr in gates) + "."]
    return out + [""]


def _dominance(q: dict) -> list[str]:
    """Plain words: which lossy river configuration is beaten on both axes by plain quantization."""
    c = q["configs"]
    # the shipped type re-quantized from the backbone (its weights rounded to F16) lands next to the shipped weights
    # themselves: no quantization choice a user has, so not a fair point
    plain = {k: v for k, v in c.items() if k.startswith("q") and k != q.get("shipped_type")}
    lossy = {k: v for k, v in c.items() if k in ("river", "fast", "gated", "random") or k.startswith("tau=")}
    out = []
    for k, v in lossy.items():
        beat = [p for p, pv in plain.items() if pv["speed_ratio"] >= v["speed_ratio"] and pv["kl"] <= v["kl"]]
        if beat:
            b = min(beat, key=lambda p: plain[p]["kl"])
            out.append(f"- **{k}** is dominated by plain {b.upper()}: {plain[b]['speed_ratio']:.2f}x vs "
                       f"{v['speed_ratio']:.2f}x the backbone's speed, KL {plain[b]['kl']:.4f} vs {v['kl']:.4f}.")
        else:
            out.append(f"- **{k}** ({v['speed_ratio']:.2f}x, KL {v['kl']:.4f}) is not dominated by a plain type here.")
    return out


def _why(q: dict, cal: dict | None, modes: dict | None, lr: dict | None, rt: dict | None = None) -> list[str]:
    """Why plain quantization wins where it does, in numbers from the same JSON."""
    c, L = q["configs"], q["n_layer"]
    out = []
    if rt and (r := rt["configs"].get("river", {}).get("ratio_to_ideal_at_depth")):
        out.append(f"- Deciding: the rule reads the cosine after every layer it may exit at (one sync each); in the "
                   f"runtime benchmark the calibrated rule ran at {1 / r:.2f} of the speed its depth alone would give "
                   f"({rt['configs']['river']['decode_ratio']:.2f}x the backbone).")
    if "river" in c:
        d = c["river"]["mean_depth"]
        out.append(f"- Depth: the calibrated rule runs {d:.1f} of {L} backbone layers per token on this text, so "
                   f"{1 - d / L:.0%} of the layer work is on the 4-bit river, yet every token still pays the rest.")
    if "fast" in c and "q4_0" in c:
        out.append(f"- The river's own error: all-river (every layer and the head 4-bit) costs KL {c['fast']['kl']:.4f} "
                   f"where plain Q4_0 costs {c['q4_0']['kl']:.4f}: the river is a second rounding of weights that "
                   "are already the shipped quantization rounded to F16.")
    if cal and "fast" in c:
        ar, clean = cal["test"]["all_river"], cal.get("gate", {}).get("test_all_river")
        out.append("- KV pollution: all-river costs KL " +
                   (f"{clean['kl']:.4f} with a clean cache (the river reading backbone-written K/V), " if clean else "") +
                   f"{ar['kl']:.4f} online over {ar.get('tokens_per_prompt', 32)} tokens of the model's own text "
                   f"(its K/V feeding later tokens, calibration's unseen prompts), and {c['fast']['kl']:.4f} online on "
                   "held-out text the model did not write.")
    if lr and "river" in lr["long"]["modes"]:
        d = lr["long"]["modes"]["river"]
        out.append(f"- Along a {lr['long']['n_tokens']}-token generation the rule's KL goes from "
                   f"{d['kl_first_quarter']:.4f} (first quarter) to {d['kl_last_quarter']:.4f} (last quarter).")
    if q.get("head_share") is not None:
        out.append(f"- The LM head: any exit >= 0 keeps the backbone's F16 head, {q['head_share']:.0%} of a backbone "
                   "step's weight bytes, read in full by every token however early it exits (plain Q4_0 reads a "
                   "Q6_K head; all-river and drafts read the river's Q4_0 head).")
    if modes:
        fm = {k: v["file_mib"] for k, v in modes["configs"].items()}
        if "q4_0" in fm:
            out.append(f"- Memory: the river GGUF holds both weight sets, {fm['backbone']:.0f} MiB against "
                       f"{fm['q4_0']:.0f} MiB for plain Q4_0.")
    return out


def _eval(evals: dict[str, dict]) -> list[str]:
    if not evals:
        return []
    first = next(iter(evals.values()))
    out = [f"**Accuracy, {first['model']}** (`river eval --task T --limit N --configs {','.join(EVAL_CONFIGS)}`; greedy, "
           f"chat template, problems interleaved across configurations so speeds come from the same run; {where(first)}, "
           f"{_built(first)}):",
           "",
           "| task (problems, max tokens) | " + " | ".join(first["configs"]) + " |",
           "|---|" + "---|" * len(first["configs"])]
    for t, e in evals.items():
        cells = [f"{d['accuracy']:.1%} ({d['speedup']:.2f}x, {d['mean_depth']:.1f} layers)" if d.get("speedup")
                 else f"{d['accuracy']:.1%}" for d in e["configs"].values()]
        out.append(f"| {t} ({e['problems']}, {e['max_tokens']}) | " + " | ".join(cells) + " |")
    out += ["", "Each cell: accuracy (decode speed x backbone, mean backbone layers per decode step; for exact the mix "
            "of draft steps, 0 layers, and verification batches, all layers). These runs shared the 2 cores with "
            "other jobs at times: take speeds from the decoding-modes tables, accuracy from here."]
    return out + [""]


def _spec_compare(s: dict, t: dict | None = None) -> list[str]:
    """t: the same-text pass (text_spec_compare_*.json) where one was made and covers the timed configurations."""
    t = t if t and set(s["ratio_median"]) <= set(t["identical_runs"]) else None
    same = "runs identical" if t else "rounds identical"
    out = [f"**Exact speed-ups on {s['model']}** (`.venv/bin/python -m bench.spec_compare`; {s['tokens']} greedy tokens x "
           f"{s['rounds']} rounds alternating, no intervals; peak memory in a fresh process; {where(s)}; {_built(s)}):", "",
           f"| config | tok/s | x backbone | {same} | peak MiB |", "|---|---|---|---|---|"]
    for c in s["ratio_median"]:
        n, of = (t["identical_runs"][c], t["runs"]) if t else (s["identical_rounds"][c], s["rounds"])
        out.append(f"| {c} | {s['tok_s_median'][c]:.1f} | {s['ratio_median'][c]:.2f} | {n}/{of} | "
                   f"{dash(s['peak_mib'].get(c), '{:.0f}')} |")
    fm = s["file_mib"]
    out += ["", f"Files: backbone {fm['backbone']:.0f} MiB; river GGUF (backbone + river + head) {fm['river']:.0f} MiB; "
            f"draft model {fm['draft']:.0f} MiB (loaded beside the backbone)."]
    if t:
        v = ((t.get("host") or {}).get("runtime") or {}).get("cpu_variant")
        out += ["", f"*Runs identical*: every configuration once on each of {t['runs']} distinct prompts, {t['tokens']} "
                f"greedy tokens, untimed (`--text-prompts`), on host {cpu_words(t)}, {t['threads']} threads, ggml's {v} variant"
                + (f", the variant {t['as_host']} loads, at its thread count" if t.get("as_host") else "") + f", {_built(t)}. "
                "The reference, *backbone*, is a stock `llama_cpp.Llama` on the backbone file: its prompt runs as one "
                "batch through ggml's default kernels, while exact mode writes the batch-invariant backbone's "
                "one-token text (RiverLlama's backbone mode), so a near-tie can part the two."]
    return out + [""]


def _long(lr: dict, model: str) -> list[str]:
    lo, b = lr["long"], lr["batch"]
    # the run's host is recorded with its long half (long.host)
    rec = {**lr, "host": lr.get("host") or lo.get("host")}
    out = [f"**Long and batched runs, {model}** (`bench/longrun.py`, figure `longrun_{model}.png`; {where(rec)}, "
           f"{_built(rec)}):", ""]
    for m, d in lo["modes"].items():
        out.append(f"- {lo['n_tokens']}-token generation, {m}: mean KL {d['kl_mean']:.4f} (first quarter "
                   f"{d['kl_first_quarter']:.4f}, last quarter {d['kl_last_quarter']:.4f}), top-1 {d['agreement']:.3f}, "
                   f"backbone layers {d['mean_depth']:.1f}.")
    if text := lo.get("continuation"):
        w = text.split()
        last = w[3 * len(w) // 4:]
        grams = [tuple(last[i:i + 4]) for i in range(len(last) - 3)]
        if grams:
            out.append(f"- Read with care: the backbone's own greedy text turns repetitive (its last quarter has "
                       f"{len(set(grams)) / len(grams):.0%} distinct word 4-grams), which makes late tokens easy for "
                       "every mode; what the run shows is that KL does not grow along the sequence, not that it falls.")
    out.append(f"- {b['n_seq']} sequences decoded as one batch with the rule ({b['n_tokens']} tokens each): mean KL "
               f"{b['batch_kl_mean']:.4f}, top-1 {b['batch_agreement']:.3f}, backbone layers {b['batch_mean_depth']:.1f}; "
               f"each alone: KL {b['alone_kl_mean']:.4f}, top-1 {b['alone_agreement']:.3f}, layers "
               f"{b['alone_mean_depth']:.1f} (in a batch the min cosine decides, so the batch exits later).")
    return out + [""]


def _runtime(r: dict) -> list[str]:
    c = r["configs"]
    pk = lambda k: dash((c[k].get("memory") or {}).get("peak_mib"), "{:.0f}")  # noqa: E731
    return [f"Runtime benchmark, {r['model']} (`river bench {r['model']}`; medians without intervals; {where(r)}, {_built(r)}): backbone {c['backbone']['decode_tps']:.1f} "
            f"tok/s; calibrated rule {c['river']['decode_ratio']:.2f}x at {c['river']['mean_depth']:.1f} layers; all-river "
            f"{c['all-river']['decode_ratio']:.2f}x with the backbone's head"
            + (f", {c['fast']['decode_ratio']:.2f}x with the river's (fast)" if "fast" in c else "") +
            f"; plain Q8_0 {c['q8_0']['decode_ratio']:.2f}x; plain Q4_0 "
            f"{c['q4_0']['decode_ratio']:.2f}x; prefill with the rule {c['river']['prefill_ratio']:.2f}x. Peak MiB: river "
            f"GGUF {pk('river')}, Q8_0 {pk('q8_0')}, Q4_0 {pk('q4_0')}." + _targets(r), ""]


def _targets(r: dict) -> str:
    t = r.get("targets", {})
    out = []
    if s := t.get("sweep_within_5pct_of_ideal"):
        out.append(f"forced-exit sweep: worst point {s['worst_ratio']:.3f} x the ideal line's time (target within "
                   f"5%: {'met' if s['met'] else 'not met'})")
    if d := t.get("decision_share"):
        out.append(f"exit decisions {d['value']:.2%} of the decode step ({'met' if d['met'] else 'not met'}: < 1%)")
    if p := t.get("prefill_river_vs_backbone"):
        out.append(f"prefill with the rule on {p['value']:.2f} of the backbone's ({'met' if p['met'] else 'not met'}: "
                   ">= 0.97)")
    return (" Runtime targets: " + "; ".join(out) + ".") if out else ""


def _same_answers(jsonl: Path, a: str, b: str) -> int | str:
    """Problems on which configurations a and b wrote the very same completion."""
    if not jsonl.is_file():
        return "?"
    rows = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
    by = {(r["config"], r["id"]): r["completion"] for r in rows}
    return sum(1 for (c, i), text in by.items() if c == a and by.get((b, i)) == text)


def _cpu(m: dict) -> str:
    """The host of a headline figure, in a few words: its CPU, or that its JSON predates host records."""
    cpu = ((m.get("host") or {}).get("cpu") or {}).get("model")
    return (cpu if cpu else "an older run, host not recorded") + f", {_built(m)}"


def _headline(out: Path) -> list[str]:
    """The few numbers a reader needs first, from the same JSON as the tables below."""
    h = []
    for model in (SMOL, QWEN, QWEN15):
        m = load_modes(out, model)
        if m and "exact" in m["configs"]:
            e = m["configs"]["exact"]
            vs = [f"{r:.2f}x {name}" for ref, name in (("shipped", "the shipped file"), ("q8_0", "plain Q8_0"))
                  if (r := paired_ratio(m, "exact", ref)) is not None]
            h.append(f"- Exact mode, {model}: {e['ratio_median']:.2f}x the F16 backbone's decode speed (median)"
                     + (f", {' and '.join(vs)}" if vs else "") + f"; output identical in {e['identical_runs']}/"
                     f"{e['runs']} runs ({_cpu(m)}" + (f"; the same-text pass {B.words(st['build'], _builds)}" if (st := m.get("same_text"))
                                                      else "") + ").")
    for model in (SMOL, QWEN):
        q = load_record(out, f"quality_{model}")
        if not q:
            continue
        c = q["configs"]
        g = [(c[f"gated@{r}"], c[f"gated-random@{r}"]) for r in (0.1, 0.25, 0.5) if f"gated@{r}" in c]
        if g:
            better = all(a["kl"] < b["kl"] for a, b in g)
            h.append(f"- Gated mode, {model}: KL {'below' if better else 'NOT always below'} random fallback at every "
                     f"measured rate (" + ", ".join(f"{a['kl']:.3f} vs {b['kl']:.3f}" for a, b in g) + f"; {_cpu(q)}).")
        if "river" in c and "random" in c:
            h.append(f"- The paper's rule, {model}: KL {c['river']['kl']:.3f} at {c['river']['mean_depth']:.1f} of "
                     f"{q['n_layer']} layers ({c['river']['speed_ratio']:.2f}x), random exits at the same depths {c['random']['kl']:.3f}; plain Q8_0 "
                     f"{c['q8_0']['kl']:.4f} at {c['q8_0']['speed_ratio']:.2f}x ({_cpu(q)})." if "q8_0" in c else "")
    evals = {t: e for t in FULL if (e := load_record(out, f"eval_{QWEN}_{t}"))}
    if evals:
        parts = []
        for t, e in evals.items():
            same = _same_answers(out / "eval" / Path(e["results"]).name, "exact", "backbone")
            parts.append(f"{t}: {e['configs']['exact']['correct']}/{e['problems']} correct vs "
                         f"{e['configs']['backbone']['correct']}/{e['problems']}, identical answers on {same}/{e['problems']}")
        h.append(f"- Accuracy, {QWEN}, exact mode against the backbone, problem by problem: " + "; ".join(parts) + ".")
    return (["**In short:**", ""] + [x for x in h if x] + [""]) if h else []



def _replaced(body: str, markers: tuple[str, str], text: str, page: Path | str) -> str:
    b, e = markers
    if b not in body or e not in body:
        raise SystemExit(f"{page}: no {b.split(' ')[1].split(':')[0]} markers")
    head, rest = body.split(b, 1)
    _, tail = rest.split(e, 1)
    return head + b + "\n" + text + e + tail


BEGIN, END = "<!-- results:begin (generated by `.venv/bin/python -m bench.steps report`) -->", "<!-- results:end -->"


def _plain_note(out: Path) -> str:
    """What the plain files of these JSONs are: llama-quantize recipes of the backbone, except in accuracy and
    distribution runs made before those took bench's files (ggml per tensor, head Q6_K), which are named."""
    from river_edge.measure.files import PLAIN_SOURCE

    older = []
    for p in sorted(out.glob("eval_*.json")) + sorted(out.glob("quality_*.json")):
        d = load_record(out, p.stem)
        src = d.get("plain_source") or d.get("notes", {}).get("quant_source")
        plain = [c for c in d.get("configs", {}) if c.startswith("q") and c[1:2].isdigit()]
        if plain and src != PLAIN_SOURCE:
            older.append(p.name)
    note = "plain Q8_0/Q4_K_M/Q4_0 (and others named so) are llama-quantize recipes of the backbone."
    if older:
        note += (" The plain rows of " + ", ".join(older) + " predate that: the shipped model re-quantized with "
                 "ggml one tensor at a time, the head Q6_K.")
    return note


def _modes_block(folder: Path, key: str, rel: str = "", fig=P) -> list[str]:
    """A modes section with its figure (written beside the JSON); rel: the folder under bench/results/."""
    if not (m := load_modes(folder, key)):
        return []
    fig.modes(m, folder / f"modes_{key}.png")
    return _modes(m) + [f"![modes](bench/results/{rel}modes_{key}.png)", ""]


def _runtime_block(folder: Path, model: str, rel: str = "", fig=P) -> list[str]:
    if not (r := load_record(folder, f"runtime_{model}")):
        return []
    fig.runtime(r, folder / f"runtime_{model}.png")
    return _runtime(r) + [f"![runtime](bench/results/{rel}runtime_{model}.png)", ""]


def _spec_block(folder: Path, rel: str = "") -> list[str]:
    if not (s := load_record(folder, f"spec_compare_{QWEN15}")):
        return []
    return _spec_compare(s, load_record(folder, f"text_spec_compare_{QWEN15}")) + [f"![spec_compare](bench/results/{rel}spec_compare_{QWEN15}.png)", ""]


def results_report(out: Path, readme: Path | None, front: Path | None = None, extra=None) -> str:
    """The generated section of `readme` (docs/results.md) from the JSON in `out`, its plots beside the JSON, and
    the headline table of `front` (the README) when given; returns the section's text. `extra(folder)`: more lines
    for another host's folder (bench/steps.py passes the device check's, bench/device_bench.py)."""
    if readme is None:
        return results_section(out, extra)
    rel = Path(os.path.relpath(out.resolve(), readme.resolve().parent)).as_posix()
    text = results_section(out, extra, rel=rel)
    page, top = _fill(out, text, readme.read_text(), front.read_text() if front else None, readme)
    readme.write_text(page)
    if top is not None:
        front.write_text(top)
    return text


def pages(out: Path, page: str, front: str | None, rel: str, extra=None) -> tuple[str, str | None]:
    """The texts of docs/results.md (`page`) and the README (`front`) with their generated blocks rewritten from the
    JSON in `out`, no plot drawn and nothing written (tests/test_results.py holds the committed pages to these);
    rel: `out` from the page's folder, for the plots' links."""
    return _fill(out, results_section(out, extra, _NoPlots(), rel), page, front, "results page")


def _fill(out: Path, text: str, page: str, front: str | None, name) -> tuple[str, str | None]:
    page = _replaced(page, (BEGIN, END), text, name)
    if front is not None and (h := headline(out)):
        front = _replaced(front, HEADLINE, "\n".join(h) + "\n", "README")
    if front is not None and (h := head_table(out)):
        front = _replaced(front, HEAD, "\n".join(h), "README")
    return page, front


def _steps_hours(out: Path) -> str:
    """How long the committed steps took, by their own records (bench/steps.py writes step_seconds)."""
    d = [x for p in sorted(out.glob("*.json")) if isinstance(x := load_record(out, p.stem), dict)]
    t = [x["step_seconds"] for x in d if "step_seconds" in x]
    return (f"{len(t)} steps committed here took {sum(t) / 3600:.1f} hours on 2 cores by their `step_seconds`, the "
            "accuracy runs at subsets: see their problem counts)")


class _NoPlots:
    """measure/plots when only the text is wanted: every figure call draws nothing."""
    def __getattr__(self, name):
        return lambda *a, **k: None


def results_section(out: Path, extra=None, fig=P, rel: str | None = None) -> str:
    """The generated section from the JSON in `out`, its plots drawn by `fig` (measure/plots) beside the JSON;
    rel: the plots' link prefix (None: bench/results/, as from the repository's root)."""
    global _builds
    _builds = B.load_builds(out)
    lines = ["All figures: 2 threads on a shared 2-core x86 machine, greedy decoding. Weights: the offline models "
             "ship quantized (SmolLM2-135M-Instruct Q4_1, Qwen2.5-Coder-0.5B and 1.5B Q4_K_M); the backbone is their F16 "
             "upcast (their weights rounded to F16: below), the river Q4_0 re-quantized from it (with a Q4_0 copy of the LM head for all-river drafts), and "
             f"{_plain_note(out)} Regenerate with "
             f"`make results` (all measurements, resumable; the {_steps_hours(out)} or `.venv/bin/python -m bench.steps report` (this "
             "text and the plots, from `bench/results/*.json`).", ""]
    lines += upcast.upcast_section(out) + _headline(out)
    for model in (SMOL, QWEN):
        modes = load_modes(out, model)
        q = load_record(out, f"quality_{model}")
        if c := load_record(out, f"calibration_{model}"):
            lines += _calibration(c, model)
        lines += _modes_block(out, model, fig=fig)
        if q:
            lines += _quality(q, modes)
            lines += [f"![pareto](bench/results/pareto_{model}.png) ![depth](bench/results/depth_{model}.png)", ""]
            fig.pareto(q, modes, out / f"pareto_{model}.png")
            fig.depth_hist(q, out / f"depth_{model}.png")
            lines += ["Where plain quantization dominates a lossy river configuration (faster and closer to the "
                      "backbone on the same text), in plain words:", ""] + _dominance(q) + ["", "Why:", ""]
            lines += _why(q, load_record(out, f"calibration_{model}"), modes, load_record(out, f"longrun_{model}"),
                          load_record(out, f"runtime_{model}")) + [""]
        lines += _runtime_block(out, model, fig=fig)
        if lr := load_record(out, f"longrun_{model}"):
            lines += _long(lr, model) + [f"![longrun](bench/results/longrun_{model}.png)", ""]
    for key in (f"{QWEN}-q8_0", QWEN15, f"{QWEN15}-keep", f"{QWEN15}-q8_0"):
        lines += _modes_block(out, key, fig=fig)
    if c := load_record(out, f"calibration_{GEMMA}"):
        lines += _calibration(c, GEMMA)
    lines += _modes_block(out, GEMMA, fig=fig)
    evals = {t: e for t in FULL if (e := load_record(out, f"eval_{QWEN}_{t}"))}
    if evals:
        lines += _eval(evals)
        fig.pareto_accuracy(evals, out / f"pareto_accuracy_{QWEN}.png")
        lines += [f"![accuracy](bench/results/pareto_accuracy_{QWEN}.png)", ""]
    lines += _spec_block(out) + vcost.table(out)
    for folder in other_hosts(out):   # another host's speeds: the same sections, on their own
        sub = folder.relative_to(out).as_posix() + "/"
        lines += [f"### Other hosts: {folder.name}", "", f"Measured on another host (`bench/results/{sub}`): its "
                  "tables stand alone, never compared with the ones above.", ""]
        for key in (SMOL, QWEN, f"{QWEN}-q8_0", QWEN15, f"{QWEN15}-keep", f"{QWEN15}-q8_0"):
            lines += _modes_block(folder, key, sub, fig)
        lines += [x for m in (SMOL, QWEN) for x in _runtime_block(folder, m, sub, fig)] + _spec_block(folder, sub)
        lines += vcost.table(folder, sub)
        lines += extra(folder) if extra else []
    text = "\n".join(lines).rstrip() + "\n"
    return text if rel is None else text.replace("](bench/results/", f"]({rel}/")
