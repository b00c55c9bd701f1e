"""Levers for exact mode, priced on this host before building them (river_edge/measure/levers.py):

  draft length   exact mode drafting kmax every cycle logs each draft's top-1 probability and the backbone's
                 verdict; replayed under fixed k, under "stop after a draft below confidence tau", and under a
                 tree that rescues every rejection (the ceiling of tree verification at the best k)
  layer skipping the river's teacher-forced agreement with the backbone with its 1, 2, 4, 7 most similar layers
                 skipped (PyTorch reference), priced at the measured draft cost scaled by the bytes still read

    python bench/levers.py --model qwen2.5-coder-1.5b --out bench/results/hosts/amd-epyc-zen4

One process; costs from exact mode's own cost model in that process. Writes levers_<model>.json (host named).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from river_edge.measure import levers as LV
from river_edge.measure.bench import DEFAULT_THREADS
from river_edge.measure.files import packaged_prompts
from river_edge.measure.host import host

HERE = Path(__file__).resolve().parent


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
    sp = llm._spec
    sp.fixed_k, sp.draft_log = sp.kmax, []
    seqs = []
    for t in prompts:
        llm.create_chat_completion([{"role": "user", "content": t}], max_tokens=tokens, temperature=0.0)
        seqs.append([int(x) for x in llm.input_ids[:llm.n_tokens]])
    cm = sp.stats()["cost_model"]
    log = sp.draft_log
    del llm
    return log, cm, seqs


def skip_agreement(path: Path, seqs: list[list[int]], tokens: int, counts: list[int]) -> dict:
    """Teacher-forced agreement of the all-river pass (its layers in `order` skipped) with the backbone's argmax
    on the generated positions of seqs; and the bytes of each river layer."""
    import torch
    from gguf import GGUFReader
    from river_edge import format as F
    from river_edge.reference.model import Policy, RiverModel
    rm = RiverModel(path, emulate=False)
    L = rm.args.n_layer
    pre = [[f"{F.river_tensor(i, n)}" for n in F.LAYER_WEIGHTS] for i in range(L)]
    size = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    layer_bytes = [sum(size.get(n, 0) for n in names) for names in pre]
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
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args(argv)
    path = river_path(a.model)
    prompts = packaged_prompts(a.prompts)
    print(f"draft log: {a.model}, {len(prompts)} prompts x {a.tokens} tokens, k = kmax", flush=True)
    log, cm, seqs = draft_log(path, prompts, a.tokens, a.threads)
    draft_ms, verify_ms = cm["draft_ms"], cm["verify_ms_used"]
    p, acc = LV.judged(log)
    res = {"model": a.model, "river": str(path), "host": host(a.threads), "prompts": prompts, "tokens": a.tokens,
           "cost_model": cm, "drafts_judged": len(p), "acceptance": float(acc.mean()),
           "by_confidence": LV.by_confidence(log), "policies": LV.policies(log, draft_ms, verify_ms)}
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
    print(f"tree ceiling at k {pol['best_fixed_k']}: {pol['tree_ceiling']:.1f}")
    print("skip layers:", {n: (round(r["agreement"], 3), round(r["predicted_tok_s"], 1))
                           for n, r in res["skip_layers"].items()})
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
