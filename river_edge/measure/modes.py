"""Decoding-mode benchmark (`river bench --mode exact,gated,river,fast,backbone,q8_0,shipped`).

Every mode of one RiverLlama (river_edge/runtime/spec.py) and the files a user would run instead (plain Q8_0 / Q4_K_M /
Q4_0 made by llama-quantize from the F16 backbone, and the shipped file itself), greedy through `generate()`
(the path chat, completions and the server take), on the same chat prompts, in one process, the order
rotating every round. Exact mode runs with each drafter through the same loop and cost model
(`exact` the river, `exact:ngram` prompt lookup, `exact:ngram-cache`, `exact:river+ngram`, `exact:draft` a
separate draft model). `backbone` is the river off (the stock graph). `sync` is the river with the exit rule's
cosine read back at every exit-able layer and never exiting (every threshold 1.0): against `backbone`, what one exit
decision costs (a device-to-host sync where layers run on a GPU or an rpc-server); `river:lagged` is the rule on the
previous step's scores, which reads them once after each step instead. `offload` runs every configuration with layers on devices
(n_gpu_layers, rpc_servers: river_edge/runtime/rpc.py).
Per configuration: median over (round, prompt) of its tok/s divided by the backbone's tok/s of the same
round and prompt, with a bootstrap 95% interval; rounds are added until every interval is within
+-`ci` of its median (or `max_rounds`); how many of its tokens equal the backbone's (exact mode must give
all of them); peak memory in a fresh process; and the mode's telemetry.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from river_edge import format as F, zoo
from river_edge.format import MODES, RiverError
from river_edge.gguf_tools.inspect import inspect_gguf
from river_edge.host import devices, host, placement
from river_edge.measure import bench as B, files as BF
from river_edge.measure.files import PLAIN_FILES
from river_edge.measure.harness import alternate, bootstrap_ci, paired, parse_configs, timed_greedy, within
from river_edge.measure.probe import in_fresh_process, load_avg, peak_rss
from river_edge.progress import no_progress
from river_edge.tokenizer import Tokenizer

SPEC = ("exact:ngram", "exact:ngram-cache", "exact:river+ngram", "exact:head", "exact:draft")   # other drafters
SYNC = ("sync",)   # the rule checking every layer and never exiting: the cost of the exit decisions
LAGGED = ("river:lagged",)   # the rule on the previous step's scores: no sync inside the graph
# exact mode verifying on the batched kernels (no batch invariance, patches/0013; the near-tie guard instead)
NOINV = ("exact:no-invariance",)
CONFIGS = MODES + LAGGED + SPEC + SYNC + NOINV + PLAIN_FILES
DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}    # the zoo's default draft model per model
DEFAULTS = dict(tokens=64, rounds=3, n_prompts=4, max_rounds=12, ci=0.05)
QUICK_MODES = dict(tokens=12, rounds=1, n_prompts=1, max_rounds=1, memory=False)   # --quick: no memory probes


def parse_modes(text: str) -> list[str]:
    return parse_configs(text, CONFIGS, kind="mode")


def configure(llm, config: str, draft_gguf=None) -> None:
    """One RiverLlama set to a configuration of the river GGUF (not a plain file), as timing and the memory probe
    both run it: the mode of `mode[:variant]` (F.split_mode) and what the variant sets; `draft_gguf` drafts
    exact:draft."""
    if config == "sync":   # the per-layer sync rule (not a lagged one a config before left set)
        llm.mode, llm.decide, llm.thresholds = "river", "sync", 1.0   # s > 1 never holds: all checked, none exits
        return
    mode, variant = F.split_mode(config)
    llm.decide = "lagged" if config in LAGGED else "sync"
    llm.batch_invariant = config not in NOINV
    llm.mode = mode
    if mode == "exact":   # the variant names the drafter, but for exact:no-invariance (the river)
        llm.drafter = draft_gguf if variant == "draft" else "river" if config in NOINV or not variant else variant


def draft_for(river_path: Path, draft: str | Path | None, progress=None) -> Path:
    """The draft model of `exact:draft`: the one given (a GGUF or a zoo name), else the zoo's default."""
    if draft is None:
        draft = DRAFTS.get(BF.source_model(inspect_gguf(river_path)) or "")
        if draft is None:
            raise RiverError(f"exact:draft: no default draft model for {river_path.name}; give one with --draft")
    return zoo.resolve(draft, progress)


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_modes(river_path: str | Path, modes: Sequence[str], *, threads: int = B.DEFAULT_THREADS,
        tokens: int = DEFAULTS["tokens"], rounds: int = DEFAULTS["rounds"], n_prompts: int = DEFAULTS["n_prompts"],
        max_rounds: int = DEFAULTS["max_rounds"], ci: float = DEFAULTS["ci"], draft: str | Path | None = None,
        memory: bool = True, prompts: Sequence[str] | None = None, offload: dict | None = None,
        flash_attn: bool = False, progress=None) -> dict:
    say = progress or no_progress
    if tokens < 2 or rounds < 1 or threads < 1:
        raise RiverError("tokens must be at least 2, rounds and threads at least 1")
    max_rounds = max(rounds, max_rounds)
    river_path = Path(river_path)
    draft_file = draft_for(river_path, draft, say) if "exact:draft" in modes else None   # refused before writing
    files, notes = BF.prepare_files(river_path, say, plain=[q for q in modes if q in PLAIN_FILES and q != "shipped"],
                                   shipped="shipped" in modes)
    cfgs = ["backbone"] + [m for m in modes if m != "backbone"]
    if draft_file is not None:
        files["draft"] = draft_file
    texts = list(prompts) if prompts else BF.packaged_prompts(n_prompts)
    chats = [Tokenizer(river_path).chat(t) for t in texts]
    n_ctx = max(len(c) for c in chats) + tokens + 16
    from river_edge.runtime.drafters import DraftModel
    from river_edge.runtime.llama import RiverLlama

    def load(path):
        return RiverLlama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=0,
                          flash_attn=flash_attn, **(offload or {}))

    llm = load(files["river"])
    if not llm.has_river:
        raise RiverError(f"{river_path}: the runtime sees no river in it (is the patched llama-cpp-python installed?)")
    plain = {q: load(files[q]) for q in cfgs if q in PLAIN_FILES}
    draft_gguf = DraftModel(files["draft"], llm) if "draft" in files else None
    tau = llm.thresholds

    def decode(c, p):
        if c in PLAIN_FILES:
            return timed_greedy(plain[c], p, tokens), {}
        configure(llm, c, draft_gguf)
        if c == "sync":
            try:
                return timed_greedy(llm, p, tokens), {}
            finally:
                llm.thresholds = tau
        mode = llm.mode
        if mode == "river":
            llm.reset_stats()
        out = timed_greedy(llm, p, tokens)
        st = llm.stats()
        if mode == "river":
            st["hist"] = llm.exit_histogram().tolist()
        return out, st

    say("warming up", 0, len(cfgs))
    for i, c in enumerate(cfgs):      # graphs, page touches, and the exact mode's cost model
        decode(c, chats[0])
        say("warming up", i + 1, len(cfgs))
    load_before = load_avg()
    t_start = time.time()
    raw = alternate(cfgs, chats, decode, rounds=rounds, max_rounds=max_rounds, say=say,
                    settled=lambda rs: within([{c: x["results"][c][0][1] for c in cfgs} for x in rs], cfgs, ci))
    # one row per (round, prompt): {config: tok/s}, {config: request seconds}, {config: common prefix}
    rows = [{"round": x["round"], "prompt": x["item"],
             "tok_s": {c: x["results"][c][0][1] for c in cfgs}, "request_s": {c: x["results"][c][0][2] for c in cfgs},
             "common_prefix": {c: _common(x["results"][c][0][0], x["results"]["backbone"][0][0]) for c in cfgs}}
            for x in raw]
    stats = {c: [x["results"][c][1] for x in raw] for c in cfgs}
    r = raw[-1]["round"] + 1
    load_after = load_avg()
    mem = {}
    if memory and not offload:   # weights on other devices or hosts: this process's peak says little
        for i, c in enumerate(cfgs):
            say("peak memory (a fresh process per configuration)", i, len(cfgs))
            mem[c] = _memory(files, c, n_ctx, threads, chats[0], flash_attn)
    res = dict(
        kind="modes", model=BF.stem(river_path), river_gguf=str(river_path), files={k: str(v) for k, v in files.items()},
        weights=BF.weights_note(notes), notes=notes, threads=threads, tokens=tokens, rounds=r, min_rounds=rounds,
        max_rounds=max_rounds, ci_target=ci, settled=within([x["tok_s"] for x in rows], cfgs, ci), prompts=texts,
        prompt_tokens=[len(c) for c in chats], elapsed_s=time.time() - t_start, load_before=load_before,
        load_after=load_after, cpu_count=os.cpu_count(), rows=rows, configs={},
        timing="decode: first token (from the prompt's logits, every configuration alike) to the n-th after it; "
               "request: generate() called to the n-th token, prefill included",
        # the host and where ggml put each file's weights: figures from other hosts never share a table
        flash_attn=flash_attn, host=host(threads),
        buffer_types={"river": placement(llm), **{q: placement(m) for q, m in plain.items()}},
        offload=_offload_note(offload))
    for c in cfgs:
        ratio, med, ci95 = paired([x["tok_s"] for x in rows], c)
        _, req_med, req_ci = paired([x["request_s"] for x in rows], c, inverse=True)
        same = [row["common_prefix"][c] for row in rows]
        f = files[c if c in PLAIN_FILES else "river"]
        d = {"tok_s_median": float(np.median([row["tok_s"][c] for row in rows])),
             "ratio_median": med, "ratio_min": float(min(ratio)), "ratio_max": float(max(ratio)), "ratio_ci95": ci95,
             "request_ratio_median": req_med, "request_ratio_ci95": req_ci,
             "identical_runs": sum(s == tokens for s in same), "runs": len(same),
             "common_prefix_mean": float(np.mean(same)),
             "file_mib": (f.stat().st_size + (files["draft"].stat().st_size if c == "exact:draft" else 0)) / 2**20,
             "memory": mem.get(c)}
        d.update(_telemetry(c, stats[c], llm.n_layer))
        res["configs"][c] = d
    if "sync" in cfgs:
        res["configs"]["sync"].update(_sync_cost(rows, llm.n_layer - 1 - llm.min_exit_layer))
    return res


def _offload_note(offload: dict | None) -> dict | None:
    """What ran where: n_gpu_layers, the rpc-servers named, and ggml's device list of this process."""
    if not offload:
        return None

    return {**offload, "devices": devices()}


def _sync_cost(rows: list[dict], n_checked: int) -> dict:
    """Per exit-able layer, what reading its cosine back costs: (step with every layer checked - backbone step)
    / layers checked, per (round, prompt), median and bootstrap 95% interval in microseconds."""
    per = [(1 / r["tok_s"]["sync"] - 1 / r["tok_s"]["backbone"]) / n_checked * 1e6 for r in rows]
    return {"layers_checked": n_checked, "sync_us_per_layer_median": float(np.median(per)),
            "sync_us_per_layer_ci95": bootstrap_ci(per)}


def _memory(files: dict, c: str, n_ctx: int, threads: int, prompt: list[int], flash_attn: bool) -> dict:
    """Peak RSS of a fresh process that loads configuration c's file(s) and generates 16 tokens in it."""
    return in_fresh_process("river_edge.measure.modes", {
        "path": str(files[c] if c in PLAIN_FILES else files["river"]), "config": c, "draft": str(files.get("draft", "")),
        "n_ctx": n_ctx, "threads": threads, "prompt": prompt, "flash_attn": flash_attn})


def _memory_probe(arg: str) -> None:
    from river_edge.runtime.drafters import DraftModel
    from river_edge.runtime.llama import RiverLlama

    a = json.loads(arg)

    def load():
        m = RiverLlama(a["path"], n_ctx=a["n_ctx"], n_threads=a["threads"], n_threads_batch=a["threads"], seed=0,
                       flash_attn=a["flash_attn"])
        if a["config"] not in PLAIN_FILES:
            configure(m, a["config"], DraftModel(a["draft"], m) if a["config"] == "exact:draft" else None)
        return m
    print(json.dumps(peak_rss(load, lambda m: timed_greedy(m, a["prompt"], 16))))


def _telemetry(c: str, sts: list[dict], n_layer: int) -> dict:
    if c.startswith("exact"):
        drafted, acc = sum(s["drafted"] for s in sts), sum(s["accepted"] for s in sts)
        cycles, toks = sum(s["cycles"] for s in sts), sum(s["tokens"] for s in sts)
        return {"acceptance_rate": acc / drafted if drafted else None, "mean_draft_len": drafted / max(cycles, 1),
                "tokens_per_cycle": toks / max(cycles, 1), "cost_model": sts[-1].get("cost_model"),
                "by_drafter": _sum_by(sts)}
    if c == "gated":
        fb, toks = sum(s["fallbacks"] for s in sts), sum(s["tokens"] for s in sts)
        return {"fallback_rate": fb / max(toks, 1), "gate_entropy": sts[-1].get("gate_entropy")}
    if c.startswith("river"):
        h = np.sum([s["hist"] for s in sts], axis=0)
        return {"mean_depth": F.mean_depth(h), "hist": h.tolist()}
    return {}


def _sum_by(sts: list[dict]) -> dict:
    out: dict = {}
    for s in sts:
        for src, v in (s.get("by_drafter") or {}).items():
            o = out.setdefault(src, {"cycles": 0, "drafted": 0, "accepted": 0})
            for k in o:
                o[k] += v[k]
    for o in out.values():
        o["acceptance_rate"] = o["accepted"] / o["drafted"] if o["drafted"] else None
    return out


def note(c: str, d: dict, res: dict) -> str:
    """The telemetry worth a word for configuration c: acceptance, fallback rate, depth or file size."""
    if d.get("acceptance_rate") is not None:
        return f"acceptance {d['acceptance_rate']:.2f}, {d['tokens_per_cycle']:.1f} tokens per cycle"
    if "fallback_rate" in d:
        return f"fallback rate {d['fallback_rate']:.2f}"
    if "mean_depth" in d:
        return f"backbone layers {d['mean_depth']:.1f}/{res['notes']['n_layer']}"
    if "sync_us_per_layer_median" in d:
        lo, hi = d["sync_us_per_layer_ci95"]
        return f"{d['sync_us_per_layer_median']:.0f} us per checked layer ({lo:.0f}-{hi:.0f}), {d['layers_checked']} checked"
    if c in PLAIN_FILES:
        return f"plain file {d['file_mib']:.0f} MiB (river GGUF {res['configs']['backbone']['file_mib']:.0f})"
    return ""


def format_modes(res: dict) -> str:
    cpu = (res.get("host") or {}).get("cpu") or {}
    lines = [f"{res['model']}: {res['weights']}",
             f"host {cpu.get('model', '?')} ({', '.join(cpu.get('isa', []))}), {res['threads']} threads, load average "
             f"{res['load_before']['loadavg_1_5_15'][0]}; greedy, {res['tokens']} tokens x {len(res['prompts'])} "
             f"chat prompts x {res['rounds']} rounds" + ("" if res.get("settled", True) else
                                                         f" (intervals not within +-{res['ci_target']:.0%})"),
             f"{'config':18} {'tok/s':>6} {'x backbone (95% CI)':>20} {'request':>8} {'peak MiB':>8} "
             f"{'same as backbone':>17}  notes"]
    for c, d in res["configs"].items():
        lo, hi = d.get("ratio_ci95") or (d["ratio_min"], d["ratio_max"])
        mem = (d.get("memory") or {}).get("peak_mib")
        lines.append(f"{c:18} {d['tok_s_median']:6.1f} {d['ratio_median']:6.2f}x ({lo:.2f}-{hi:.2f}) "
                     f"{d.get('request_ratio_median', float('nan')):7.2f}x {'-' if mem is None else str(round(mem)):>8} "
                     f"{d['identical_runs']:>5}/{d['runs']} runs ({d['common_prefix_mean']:.0f} tok)  {note(c, d, res)}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--memory-probe":
        _memory_probe(sys.argv[2])
