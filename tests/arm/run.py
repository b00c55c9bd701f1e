"""`make test-arm`: the runtime cross-built for aarch64 (patches/cross.py), its invariants run under qemu-user as
several ARM CPUs, each CPU's record in OUT/<cpu>.json and a table at the end.

Per emulated CPU, in aarch64 Python under qemu, two at a time (one per core):
- probe.py: the ggml CPU variant that loaded (and which the CPU could run), where the weights of the tiny models
  landed (CPU_REPACK or CPU) and the repacked layouts ggml chose, `river doctor`'s report, and teacher-forced logits
  under several exits; those logits are compared with the x86 host's (its reference path, extra buffer types off),
  which the x86 suite checks against the PyTorch reference: a wrong ARM kernel would pass the self-comparisons below;
- pytest: tests/test_cpu_variants.py's invariants that compare the runtime with itself (river off = the stock model
  bit for bit, forced exits = a stock model with later layers swapped, exact mode = the backbone's greedy text, a
  row's bits in any batch), extra buffer types on and off, split over the CPUs to fit CI (selection()); the
  comparisons with the PyTorch reference skip (no torch on aarch64 here: PyPI's is a CUDA build).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECORDS = ROOT / "bench" / "results" / "arm"
sys.path[:0] = [str(ROOT / "patches"), str(ROOT / "tests")]
import cross  # noqa: E402  (patches/cross.py)
from sysroot import Arm  # noqa: E402

# armv8.0 (no dotprod), dotprod + fp16, SVE-256 with i8mm (no SVE2), everything qemu has (SVE2, SME, 512-bit SVE)
CPUS = ["cortex-a53", "cortex-a76", "neoverse-v1", "max"]
SVE = ("neoverse-v1", "max")   # the fewest tests (selection())
ORDER = ["cortex-a76", "cortex-a53", "neoverse-v1", "max"]   # the longest first: two at a time finish together
# ARM's logits against x86's (its reference path, extra buffer types off): the worst row's max |a - b| / max |b|.
# Not bit for bit, nor within the suite's 1e-3 to the PyTorch reference: ggml's ARM kernels round F16 differently
# (without FP16 arithmetic llamafile's sgemm takes F32 activations unrounded; with it but without SVE, F16 dot products
# accumulate in half precision: 2-3e-3 on an F16 backbone), and on these tiny random models the next quantized layer's
# Q8 rounding of activations flips on that and amplifies it: up to 0.051 seen (cortex-a76, the 256-wide Q5_K model),
# 0.030 on the river GGUFs (bench/results/arm). What the check is for is further off: on a river GGUF, one layer on the
# other weight set moves a row by 0.09-0.12 (x86), so their tolerance sits between (1.5x the noise, half the bug);
# on the plain models a model quantized to Q4_0 instead of Q8_0 moves it by 0.4.
TOL_RIVER, TOL_PLAIN = 0.045, 0.08


def selection(cpu: str, repacks: bool) -> str:
    """tests/test_cpu_variants.py's invariants (what each x86 CPU variant runs), cut to fit CI under emulation.
    Every CPU: llama's runtime invariants. The two without SVE: every architecture (graphs are the same C++ on any
    ISA: a53 runs them plain, a76 with their river repacked), the batch-invariance matrix over every weight type,
    flash attention's two; a76 the 512-token exact run. The SVE CPUs, which qemu runs 3-4x slower (a 256-wide
    model's token: 294 ms on neoverse-v1, 87 ms on cortex-a76): their repacked layouts only, extra buffer types on,
    Q4_0, Q8_0, Q4_K and Q6_K for batch invariance. Where a CPU repacks nothing, extra buffer types change nothing:
    only their off half runs."""
    from test_cpu_variants import INVARIANTS

    # (Q4_1 and Q5_0 take patch 0018's multi-column kernels on x86 only: on ARM their one-row loop is Q4_0's and
    # Q8_0's, which run here, and the two cost about 70 s a CPU under emulation)
    k = f"({INVARIANTS}) and not (same_bits and not (llama- or flash_attention)) and not (same_bits and (q4_1 or q5_0))"
    if cpu in SVE:
        k += " and llama- and not no_extra_bufts and not (same_bits and not (q4_0 or q8_0 or q4_k or q6_k))"
    elif cpu == "cortex-a76":
        k += " and not (no_extra_bufts and not llama-) and not (512_tokens and not tiny_llama])"
    else:
        k += " and not 512_tokens"
    return k if repacks else f"{k} and not (extra_bufts and not no_extra_bufts)"


def write_models(d: Path) -> None:
    """The suite's tiny river GGUFs (conftest.TINY: every architecture) and plain models of the types ggml repacks
    on ARM (Q4_0 into 4x4/4x8/8x8 by dotprod/i8mm/SVE width, Q8_0, the k-quants), rows wide enough for every layout."""
    try:
        from conftest import TINY
    except ImportError:   # a conftest without its table of tiny models: one per architecture
        from river_edge.format import ARCHITECTURES
        TINY = {a: dict(arch=a, seed=i) for i, a in enumerate(ARCHITECTURES)}
    from river_edge.gguf_tools.build import build_river
    from river_edge.gguf_tools.tiny import write_tiny_model

    (d / "src").mkdir(exist_ok=True)
    for name, spec in TINY.items():
        kw = dict(spec)
        base = write_tiny_model(d / "src" / f"{name}-base.gguf", kw.pop("arch"), **kw)
        build_river(base, d / f"river-{name}.gguf")
    for t in ("q4_0", "q8_0", "q4_k", "q5_k", "q6_k"):
        write_tiny_model(d / f"llama-{t}.gguf", "llama", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, wtype=t, seed=5)


def compare(arm: Path, x86: Path) -> dict:
    """Per configuration the worst row error of ARM's logits against x86's, and whether it is within its tolerance
    (TOL_RIVER on the river GGUFs, TOL_PLAIN on the plain models)."""
    a, b = np.load(arm), np.load(x86)
    out = {}
    for k in a.files:
        model, cfg, _ = k.split("|")
        want = b[f"{model}|{cfg}|plain"]
        err = (np.abs(a[k] - want) / np.abs(want).max(-1, keepdims=True)).max(-1)
        tol = TOL_RIVER if model.startswith("river-") else TOL_PLAIN
        out[k] = {"q90": float(np.quantile(err, 0.9)), "max": float(err.max()), "tol": tol, "ok": bool(err.max() < tol)}
    return out


def junit(path: Path) -> dict:
    try:
        s = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {"passed": 0, "failed": 1, "skipped": 0, "note": "no junit report (pytest crashed or timed out)"}
    s = s if s.tag == "testsuite" else s.find("testsuite")
    n, f, e, k = (int(s.get(x, 0)) for x in ("tests", "failures", "errors", "skipped"))
    failed = [c.get("name") for c in s.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    reasons = sorted({x.get("message", "")[:160] for c in s.iter("testcase") for x in c.findall("skipped")})
    slowest = sorted(((float(c.get("time", 0)), c.get("name")) for c in s.iter("testcase")), reverse=True)[:8]
    return {"passed": n - f - e - k, "failed": f + e, "skipped": k, "failures": failed, "skip_reasons": reasons,
            "slowest_s": {name: round(t, 1) for t, name in slowest}}


def run_cpu(arm: Arm, cpu: str, models: Path, x86_npz: Path, out: Path, work: Path, timeout: int) -> dict:
    rec: dict = {"cpu": cpu}
    t0 = time.monotonic()
    pj, pn = work / f"{cpu}.probe.json", work / f"{cpu}.npz"
    r = subprocess.run(arm.cmd(cpu, str(HERE / "probe.py"), str(models), str(pj), str(pn)), env=arm.env(),
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        rec["probe_error"] = (r.stdout + r.stderr)[-3000:]
    else:
        info = json.loads(pj.read_text())
        info["cpuinfo"] = info.pop("cpu")   # what the emulated CPU shows in /proc/cpuinfo
        rec.update(info)
        rec["logits_vs_x86"] = compare(pn, x86_npz)
    rec["probe_wall_s"] = round(time.monotonic() - t0, 1)
    t1 = time.monotonic()
    xml = work / f"{cpu}.junit.xml"
    rec["selection"] = selection(cpu, "models" not in rec or any(m["repacked"] for m in rec["models"].values()))
    cmd = arm.cmd(cpu, "-m", "pytest", "-q", "-p", "one_thread", "-p", "no:cacheprovider", f"--junitxml={xml}",
                  "-o", "junit_family=xunit1", f"--basetemp={work / ('pytest-' + cpu)}",
                  "tests/test_runtime.py", "tests/test_invariance.py", "-k", rec["selection"])
    try:
        r = subprocess.run(cmd, env=arm.env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        tail = (r.stdout + r.stderr)[-4000:]
    except subprocess.TimeoutExpired as e:
        tail = f"timed out after {timeout} s\n" + ((e.stdout or b"")[-3000:].decode(errors="replace"))
    rec["pytest"] = junit(xml)
    if rec["pytest"]["failed"]:
        rec["pytest"]["tail"] = tail
    rec["pytest_wall_s"] = round(time.monotonic() - t1, 1)
    (out / f"{cpu}.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def row(rec: dict) -> list[str]:
    models = rec.get("models", {})
    layouts = sorted({k for m in models.values() for k in m["repacked"]})
    bufts = sorted({b for m in models.values() for role in m["placement"].values() for b in role})
    errs = rec.get("logits_vs_x86", {})
    worst = max((v["max"] for v in errs.values()), default=float("nan"))
    p = rec["pytest"]
    info = rec.get("system_info") or ""
    feats = [f for f in ("DOTPROD", "FP16_VA", "MATMUL_INT8", "SVE", "SME") if f"{f} = 1" in info]
    sve = next((w.split("=")[1].strip() for w in info.split("|") if "SVE_CNT" in w), "")
    return [rec["cpu"], rec.get("cpu_variant") or "?", " ".join(feats) + (f" (SVE {int(sve) * 8} bit)" if sve else ""),
            ", ".join(bufts), ", ".join(layouts) or "none",
            f"{worst:.1e} {'ok' if all(v['ok'] for v in errs.values()) and errs else 'FAIL'}",
            f"{p['passed']}/{p['failed']}/{p['skipped']}", f"{rec['probe_wall_s'] + rec['pytest_wall_s']:.0f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", default=",".join(CPUS), help="qemu -cpu models, comma-separated")
    ap.add_argument("--out", help="folder of the per-CPU JSON (default: a new temporary folder, named at the end)")
    ap.add_argument("--record", action="store_true",
                    help=f"write them to {RECORDS.relative_to(ROOT)}, the committed records the docs cite")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per qemu run")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="CPUs emulated at once")
    args = ap.parse_args()
    if args.record and args.out:
        ap.error("--record writes to the committed records; --out names another folder: give one")
    # a plain run must not rewrite the committed records (a check is not a new measurement)
    out = RECORDS if args.record else Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="river-arm-records-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    pkg = cross.build_aarch64()
    build_s = time.monotonic() - t0
    arm = Arm(pkg)
    setup_s = time.monotonic() - t0 - build_s
    with tempfile.TemporaryDirectory(prefix="river-arm-") as w:
        work, models = Path(w), Path(w) / "models"
        models.mkdir()
        write_models(models)
        x86 = subprocess.run([sys.executable, str(HERE / "probe.py"), str(models), str(work / "x86.json"),
                              str(work / "x86.npz")], capture_output=True, text=True)
        if x86.returncode:
            raise SystemExit("the x86 probe failed:\n" + x86.stderr[-3000:])
        # one qemu process per core: each runs its model on one thread (one_thread.py), Python between its steps
        cpus = args.cpus.split(",")
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {cpu: pool.submit(run_cpu, arm, cpu, models, work / "x86.npz", out, work, args.timeout)
                       for cpu in sorted(cpus, key=lambda c: ORDER.index(c) if c in ORDER else -1)}
            for cpu, fut in futures.items():
                rec = fut.result()
                p = rec["pytest"]
                print(f"== {cpu}: variant {rec.get('cpu_variant')}; pytest {p['passed']} passed, {p['failed']} failed, "
                      f"{p['skipped']} skipped; {rec['probe_wall_s'] + rec['pytest_wall_s']:.0f} s", flush=True)
        recs = [futures[c].result() for c in cpus]
    head = ["qemu -cpu", "variant loaded", "ggml features (none: armv8.0 NEON)", "weight buffer types",
            "repacked layouts", "logits vs x86 (max row err)", "pytest pass/fail/skip", "s"]
    rows = [head, ["---"] * len(head)] + [row(r) for r in recs]
    print("\n" + "\n".join("| " + " | ".join(r) + " |" for r in rows))
    print(f"\nruntime {pkg.parent.name}: {build_s:.0f} s (cached when ~0); qemu, sysroot and wheels {setup_s:.0f} s; "
          f"total {time.monotonic() - t0:.0f} s; records in {out}")
    bad = [r["cpu"] for r in recs if "probe_error" in r or r["pytest"]["failed"] or not r["pytest"]["passed"]
           or not all(v["ok"] for v in r.get("logits_vs_x86", {}).values())]
    if bad:
        for r in recs:
            if r["cpu"] in bad:
                print(f"\n== {r['cpu']} failed:\n{r.get('probe_error', '')}{r['pytest'].get('tail', '')}"
                      f"{json.dumps({k: v for k, v in r.get('logits_vs_x86', {}).items() if not v['ok']})}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
