"""The device check's benchmarks (bench/device_check.py runs this with the runtime it installed on the path).

Per zoo model, at its real shape with random weights (the models cannot travel to the GPU machine: see
device_check.py): a river GGUF (F16 backbone, Q4_0 river, as `river build` makes from a shipped file), the rule's
thresholds set so its mean exit depth is the real model's on the CPU, then the modes benchmark
(river_edge.measure.modes, the same harness as `river bench`) fully offloaded to the GPU and on the CPU at each
thread count; the host-side share of an exact cycle; and exact mode projected with the real weights' acceptance.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

GPU_MODES = "backbone,exact,river,river:lagged,q8_0,q4_k_m"
CPU_MODES = "backbone,exact,river,q8_0,q4_k_m"
PROMPT = "Write a Python function that merges two sorted lists."


def shape_model(dst: Path, shape: dict) -> Path:
    """A river GGUF at the model's shape, random weights (F16 backbone, Q4_0 river)."""
    from river_edge.gguf_tools.tiny import write_tiny_model

    kw = {k: shape[k] for k in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "vocab", "tie_embeddings")}
    return write_tiny_model(dst, shape["arch"], wtype="f16", river="q4_0", seed=0, n_ctx=4096, **kw)


def depth_thresholds(llm, target: float | None, n: int = 24) -> dict:
    """One threshold for every layer, chosen on the random model's own scores so the rule's mean exit depth
    (backbone layers per token) is `target`, the real model's: the rule then costs what it costs there."""
    L = llm.n_layer
    if target is None:
        target = 0.75 * L
    llm.mode, llm.decide, llm.thresholds = "river", "sync", 1.0   # every layer scored, none exits
    toks = llm.tokenize(PROMPT.encode())
    llm.reset()
    llm.eval(toks)
    S = []
    for _ in range(n):   # one-token steps: a prompt's scores are the minimum over its tokens
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        S.append(llm.last_scores())
    S = np.nan_to_num(np.array(S, dtype=np.float32), nan=-1.0)   # NaN: a layer not scored
    lo = llm.min_exit_layer

    def depth(tau):   # the rule: exit after the first scored layer from min_exit on whose score exceeds tau
        hit = S[:, lo:] > tau
        first = np.where(hit.any(1), hit.argmax(1) + lo, L - 1)
        return float(np.mean(first + 1))
    # just below each score seen (float32, as the graph compares), so that score exits
    s = np.unique(S[:, lo:][(S[:, lo:] >= 0) & (S[:, lo:] <= 1)])
    cands = [max(0.0, float(np.nextafter(x, np.float32(-1)))) for x in s] + [1.0]
    best = min(cands, key=lambda t: abs(depth(t) - target))
    llm.thresholds = float(best)
    return {"tau": float(best), "target_depth": target, "depth_on_scores": depth(best)}


def host_share(llm, tokens: int) -> dict:
    """Exact mode's host-side work per cycle: wall time minus the time inside llama_decode and the logits reads
    (where a GPU backend synchronizes), over one greedy generation."""
    import llama_cpp.llama_cpp as C

    spent = [0.0]
    orig = {n: getattr(C, n) for n in ("llama_decode", "llama_get_logits", "llama_get_logits_ith")}

    def timed(f):
        def g(*a):
            t0 = time.perf_counter()
            try:
                return f(*a)
            finally:
                spent[0] += time.perf_counter() - t0
        return g
    llm.mode = "exact"
    toks = llm.tokenize(PROMPT.encode())
    g = llm.generate(toks, temp=0.0)   # the cost model's start-up probe runs here, untimed
    for _ in range(4):
        next(g)
    g.close()
    for n, f in orig.items():
        setattr(C, n, timed(f))
    try:
        llm.reset_stats()
        t0 = time.perf_counter()
        g = llm.generate(toks, temp=0.0)
        for _ in range(tokens):
            next(g)
        g.close()
        wall = time.perf_counter() - t0
    finally:
        for n, f in orig.items():
            setattr(C, n, f)
    st = llm.stats()
    return {"wall_s": wall, "in_ggml_s": spent[0], "host_share": 1 - spent[0] / wall, "cycles": st.get("cycles"),
            "host_ms_per_cycle": 1e3 * (wall - spent[0]) / max(1, st.get("cycles") or 1),
            "acceptance": st.get("acceptance_rate"), "tokens": tokens}


def projection(cost: dict | None, acceptance: float | None) -> dict:
    """Exact mode's speed over the backbone's from the measured costs at acceptance a: the k exact mode itself
    would choose (runtime/costs.py, through levers.iid_rate)."""
    from bench.replay import iid_rate

    if not cost or acceptance is None:
        return {}
    tok_s, k = iid_rate(acceptance, cost["draft_ms"], cost["verify_ms_used"])
    return {"acceptance": acceptance, "k": k, "ratio": tok_s * cost["verify_ms_used"][0] / 1e3}


def device_section(folder: Path) -> list[str]:
    """The device check's JSON (bench/device_check.py): each model at its shape, on the GPU and the CPU."""
    from bench.recorded import load_record
    from bench.report import _modes

    if not (d := load_record(folder, "device_check")):
        return []
    p, t = d["probe"], d.get("tests") or {}
    out = [f"Device check: {p.get('gpu') or 'no GPU'}; {p.get('cpu')}, {p.get('cores')} cores; runtime "
           f"{(d.get('runtime') or {}).get('how')}; CUDA invariants " + (f"exit {t['returncode']}" if "returncode" in t
           else t.get("skipped", "not run")) + ". " + (d.get("bench") or {}).get("weights", ""), ""]
    for name, row in ((d.get("bench") or {}).get("models") or {}).items():
        for r in (v for k, v in row.items() if k == "gpu" or k.startswith("cpu")):
            if r and "configs" in r:
                pr = r["projection"].get("real_weights") or {}
                out += _modes(r)[:-1] + ([f"Exact mode at the real weights' acceptance {pr['acceptance']:.2f} "
                                          f"(cost model): k = {pr['k']}, {pr['ratio']:.2f}x the backbone.", ""] if pr else [""])
        if h := row.get("host_share"):
            out += [f"{name}: exact mode's host-side work {h['host_share']:.0%} of the wall time, "
                    f"{h['host_ms_per_cycle']:.2f} ms per cycle.", ""]
    return out


def main(argv=None) -> int:
    from river_edge.measure import modes as M
    from river_edge.host import devices, host
    from river_edge.runtime.llama import RiverLlama

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", type=Path, required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--budget", type=float, default=400)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args(argv)
    t_end = time.monotonic() + args.budget
    shapes = json.loads(args.shapes.read_text())
    threads = [int(t) for t in args.threads.split(",") if t]
    res = {"host": host(threads[0] if threads else None), "devices": devices(), "weights": "Weights: random, at each "
           "model's real shape (F16 backbone, Q4_0 river), so the acceptance in these tables is the random model's "
           "own; the projection uses the real weights' acceptance measured on the CPU (shapes.json).",
           "models": {}}
    save = lambda: (args.out / "device_bench.json").write_text(json.dumps(res, indent=1, default=str))  # noqa: E731
    kw = dict(tokens=args.tokens, rounds=2, max_rounds=3, n_prompts=2, memory=False)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if time.monotonic() > t_end - 30:
                res["models"][name] = {"skipped": "out of time"}
                continue
            shape, t0 = shapes[name], time.monotonic()
            path = shape_model(Path(tmp) / f"{name}.river.gguf", shape)
            row = res["models"][name] = {"shape": shape, "build_s": round(time.monotonic() - t0, 1)}
            offload = {"n_gpu_layers": -1} if args.gpu else None
            llm = RiverLlama(str(path), n_ctx=512, n_threads=threads[0] if threads else 4, seed=0,
                             **(offload or {}))
            row["thresholds"] = depth_thresholds(llm, (shape.get("cpu") or {}).get("mean_depth"))
            tau = llm.thresholds
            row["host_share"] = host_share(llm, args.tokens)
            llm.close()
            from river_edge.gguf_tools.build import set_river_keys
            tuned = path.with_name(f"{name}.tuned.river.gguf")
            set_river_keys(path, tuned, thresholds=tau)
            runs = [("gpu", GPU_MODES, threads[0] if threads else 4, offload)] if args.gpu else []
            runs += [(f"cpu{t}", CPU_MODES, t, None) for t in threads]
            for key, modes, t, off in runs:
                if time.monotonic() > t_end - 20:
                    row[key] = {"skipped": "out of time"}
                    continue
                r = M.run_modes(tuned, M.parse_modes(modes), threads=t, offload=off, **kw)
                ex = r["configs"].get("exact", {})
                r["projection"] = {"real_weights": projection(ex.get("cost_model"), (shape.get("cpu") or {}).get("acceptance")),
                                   "sweep": [projection(ex.get("cost_model"), a) for a in (0.6, 0.8, 0.9, 0.95)]}
                r["model"] = f"{name}-shape ({'GPU' if off else f'CPU, {t} threads'})"   # random weights: no file to name
                r.setdefault("notes", {})["calibrated"] = None   # thresholds set by depth_thresholds, not calibration
                row[key] = r
                save()
            for p in (path, tuned):
                p.unlink(missing_ok=True)
    res["medians_note"] = "ratios are medians over (round, prompt) against the backbone, bootstrap 95% intervals"
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
