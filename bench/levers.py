"""Levers for exact mode, priced on this host before building them (bench/replay.py):

  draft length   exact mode drafting kmax every cycle logs each draft's top-1 probability and the backbone's
                 verdict; replayed under fixed k, each request's own best k, "stop after a draft below confidence
                 tau", and a tree that rescues every rejection (the ceiling of tree verification at the best k)
  the built stop exact mode with its confidence stop (settings.py's draft_stop) against without, alternating
  weight types   one-token decoding of llama-quantize recipes of the backbone (q2_k .. q8_0), alternating: what
                 a draft step of a river of that type would cost here (a per-layer mix costs in between)
  layer skipping the river's teacher-forced agreement with the backbone with its 1, 2, 4, 7 most similar layers
                 skipped (PyTorch reference), priced at the measured draft cost scaled by the bytes still read

    .venv/bin/python -m bench.levers --model qwen2.5-coder-1.5b --out bench/results/hosts/amd-epyc-zen4

One process; costs from exact mode's own cost model in that process. Writes levers_<model>.json (host named).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import replay as LV
from river_edge.measure.bench import DEFAULT_THREADS
from river_edge.measure.files import packaged_prompts
from river_edge.host import host

_HERE = Path(__file__).resolve().parent


def river_path(model: str) -> Path:
    from river_edge import zoo
    from river_edge.defaults import build_calibrated_river, default_river_path
    path = default_river_path(model)
    if not path.is_file():
        build_calibrated_river(zoo.prepare(model), path, target=None, backbone="f16")
    return path


def draft_log(path: Path, prompts: list[str], tokens: int, threads: int) -> tuple[list, dict, list]:
    from river_edge.runtime.llama import RiverLlama
    llm = RiverLlama(str(path), mode="exact", n_ctx=2048, n_threads=threads, n_threads_batch=threads, seed=0,
                     verbose=False)
    sp = llm.decoding
    sp.draft_k = sp.kmax
    seqs, logs = [], []
    for t in prompts:
        sp.draft_log = []
        llm.create_chat_completion([{"role": "user", "content": t}], max_tokens=tokens, temperature=0.0)
        seqs.append([int(x) for x in llm.input_ids[:llm.n_tokens]])
        logs.append(sp.draft_log)
    from river_edge.host import placement
    cm = {**sp.stats()["cost_model"], "buffer_types": placement(llm)}
    del llm
    return logs, cm, seqs


def ab_stop(path: Path, prompts: list[str], tokens: int, threads: int, rounds: int) -> dict:
    """Exact mode with its confidence stop (draft_stop) against without, alternating on one model: decode tok/s of
    each, their paired ratio, and whether both wrote the same text."""
    from river_edge.measure.harness import alternate, paired, timed_greedy
    from river_edge.runtime.llama import RiverLlama
    from river_edge.settings import SETTINGS
    from river_edge.tokenizer import Tokenizer
    chats = [Tokenizer(path).chat(t) for t in prompts]
    llm = RiverLlama(str(path), mode="exact", n_ctx=max(map(len, chats)) + tokens + 16, n_threads=threads,
                     n_threads_batch=threads, seed=0, verbose=False)
    cfgs = ["stop", "no stop"]

    def run(c, i):
        llm.decoding.draft_stop = SETTINGS["draft_stop"].default if c == "stop" else None
        toks, tok_s, _ = timed_greedy(llm, chats[i], tokens)
        return toks, tok_s

    run("stop", 0)      # the cost model's probe and graphs, outside the clock
    rows = alternate(cfgs, list(range(len(chats))), run, rounds=rounds)
    vals = [{c: r["results"][c][1] for c in cfgs} for r in rows]
    _, med, ci = paired(vals, "stop", ref="no stop")
    return {"draft_stop": SETTINGS["draft_stop"].default, "rounds": rounds, "tokens": tokens, "prompts": len(chats),
            "tok_s": {c: sorted(v[c] for v in vals)[len(vals) // 2] for c in cfgs},
            "ratio": med, "ratio_ci95": ci,
            "same_text": sum(r["results"]["stop"][0] == r["results"]["no stop"][0] for r in rows), "runs": len(rows)}


def type_steps(path: Path, recipes: list[str], prompts: list[str], tokens: int, threads: int, rounds: int) -> dict:
    """One-token decoding of llama-quantize recipes of the backbone, alternating in this process: what a draft
    step of a river of that type (all layers, its head) would cost on this host."""
    import numpy as np
    from river_edge.measure.files import prepare_files
    from river_edge.measure.harness import alternate, timed_greedy
    from river_edge.host import placement
    from river_edge.runtime.llama import RiverLlama
    files, _ = prepare_files(path, plain=recipes)
    llms = {q: RiverLlama(str(files[q]), n_ctx=512, n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
            for q in recipes}
    toks = [llms[recipes[0]].tokenize(t.encode()) for t in prompts]
    rows = alternate(recipes, list(range(len(toks))), lambda q, i: timed_greedy(llms[q], toks[i], tokens)[1],
                     rounds=rounds)
    out = {}
    for q in recipes:
        ms = [1e3 / r["results"][q] for r in rows]
        out[q] = {"step_ms": float(np.median(ms)), "file_mib": files[q].stat().st_size / 2**20,
                  "buffer_types": placement(llms[q]).get("backbone", {})}
    return out


def skip_agreement(path: Path, seqs: list[list[int]], tokens: int, counts: list[int]) -> dict:
    """Per count n: teacher-forced agreement of the all-river pass with its n most similar layers skipped with the
    backbone's argmax on the generated positions of seqs, and the share of the river's bytes it still reads."""
    import torch
    from gguf import GGUFReader
    from river_edge import format as F
    from river_edge.reference.model import Policy, RiverModel
    rm = RiverModel(path, emulate=False)
    L = rm.args.n_layer
    size = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    layer_bytes = [sum(size.get(F.river_tensor(i, n), 0) for n in F.LAYER_WEIGHTS) for i in range(L)]
    river_bytes = sum(v for k, v in size.items() if k.startswith("river"))

    def argmax(policy, ids):
        st = rm.step([(ids, rm.new_cache(len(ids)))], policy)
        return st.logits[0].argmax(-1), st.sims

    backbone, sims = [], []
    for ids in seqs:
        a, s = argmax(Policy.backbone(), ids)
        backbone.append(a)
        sims.append(s[len(ids) - tokens:])
    order = LV.skip_order(torch.cat(sims).nanmean(0).numpy())
    full = list(rm.river)
    out = {}
    for n in counts:
        skip = set(order[:n])
        rm.river = [(lambda h, pos, attend: h) if i in skip else full[i] for i in range(L)]
        agree = total = 0
        for ids, b in zip(seqs, backbone):
            a, _ = argmax(Policy.all_river(), ids)
            lo = len(ids) - tokens          # the row before each generated token predicts it
            agree += int((a[lo - 1:-1] == b[lo - 1:-1]).sum())
            total += tokens
        out[n] = {"skipped": sorted(skip), "agreement": agree / total,
                  "bytes_kept": 1.0 - sum(layer_bytes[i] for i in skip) / river_bytes}
        print(f"  skip {n}: agreement {agree / total:.3f}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--skips", default="0,1,2,4,7")
    ap.add_argument("--ab-rounds", type=int, default=6)
    ap.add_argument("--types", default="q2_k,q3_k_m,q4_0,q4_k_m,q8_0")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    ap.add_argument("--out", type=Path, default=_HERE / "results")
    a = ap.parse_args(argv)
    path = river_path(a.model)
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    prompts = packaged_prompts(a.prompts)
    print(f"draft log: {a.model}, {len(prompts)} prompts x {a.tokens} tokens, k = kmax", flush=True)
    logs, cm, seqs = draft_log(path, prompts, a.tokens, a.threads)
    log = [c for lg in logs for c in lg]
    draft_ms, verify_ms = cm["draft_ms"], cm["verify_ms_used"]
    p, acc = LV.judged(log)
    res = {"model": a.model, "river": str(path), "host": host(a.threads), "prompts": prompts, "tokens": a.tokens,
           "cost_model": cm, "drafts_judged": len(p), "acceptance": float(acc.mean()),
           "by_confidence": LV.by_confidence(log), "policies": LV.policies(logs, draft_ms, verify_ms),
           "draft_log": logs}
    print(f"exact mode with its confidence stop against without, {a.ab_rounds} rounds", flush=True)
    res["ab_stop"] = ab_stop(path, prompts[:4], 64, a.threads, a.ab_rounds)
    print(f"draft step per weight type: {', '.join(types)}", flush=True)
    res["type_steps"] = type_steps(path, types, prompts[:2], 32, a.threads, 3)
    # the sequences exact mode wrote are the backbone's own: the teacher-forced reference reads them
    res["skip_layers"] = skip_agreement(path, seqs, a.tokens, [int(x) for x in a.skips.split(",")])
    for n, r in res["skip_layers"].items():
        r["predicted_tok_s"], r["predicted_k"] = LV.iid_rate(r["agreement"], draft_ms * r["bytes_kept"], verify_ms)
    a.out.mkdir(parents=True, exist_ok=True)
    dst = a.out / f"levers_{a.model}.json"
    tmp = dst.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=float))
    tmp.replace(dst)
    pol = res["policies"]
    print(f"acceptance {res['acceptance']:.3f} over {len(p)} judged drafts; backbone {pol['backbone_tok_s']:.1f} tok/s")
    print("fixed k:", {k: round(v, 1) for k, v in pol["fixed_k"].items()})
    print("stop below tau:", {c: {t: round(v, 1) for t, v in d.items()} for c, d in pol["stop_below"].items()})
    print(f"each request's best k: {pol['per_request_ceiling']:.1f}; tree ceiling at k {pol['best_fixed_k']}: "
          f"{pol['tree_ceiling']:.1f}")
    ab = res["ab_stop"]
    print(f"confidence stop: {ab['ratio']:.3f}x ({ab['ratio_ci95'][0]:.3f}-{ab['ratio_ci95'][1]:.3f}) of exact without it,"
          f" {ab['same_text']}/{ab['runs']} same text")
    print("one-token step (ms) per type:", {q: round(r["step_ms"], 1) for q, r in res["type_steps"].items()},
          f"(the river's draft step {draft_ms:.1f})")
    print("skip layers:", {n: (round(r["agreement"], 3), round(r["predicted_tok_s"], 1))
                           for n, r in res["skip_layers"].items()})
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
