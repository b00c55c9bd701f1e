"""Long and batched runs: does the river keep its quality over a long generation and inside a batch?

kl_along_sequence  one chat prompt, a long greedy backbone continuation (EOS ignored), and every mode
                   teacher-forced along it: KL(backbone || mode) and top-1 agreement per position. The
                   question is whether river-written K/V accumulating along the sequence makes KL drift.
kl_in_batch        4 chat prompts decoded together in one llama_context (one llama_batch of 4 tokens per
                   step) with the river rule, against each decoded alone. In a batch the rule decides per
                   ubatch on the MIN cosine over its tokens, so all 4 exit at the same layer: the batch
                   should exit later (deeper, closer to the backbone), never worse.
figure             both as one PNG.

Position i is the distribution after feeding generated token i (it predicts token i + 1): every position is
a one-token decode step, as in generation; the prompt's prefill is not scored. KL is in nats, computed in
float64 from the mode's logits and the backbone's stored log-probs.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.batched import batch_context
from river_edge import format as F
from river_edge.format import RiverError
from river_edge.host import host
from river_edge.progress import Progress

STEP_MODES = tuple(m for m in F.MODES if m not in F.LOOP_MODES)  # the loop modes pick their own tokens: not teacher-forceable
REF_BUDGET = 1 << 30  # bytes of stored backbone log-probs kept in float32; above it float16 (see _Ref)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


class _Ref:
    """The backbone's log-probs per position. float32 while n x vocab fits REF_BUDGET (exact to ~1e-7),
    else float16 (2,048 x Qwen's 152k vocab is 1.2 GB in float32). Rows are renormalised when read: a
    float16 row's rounding (~2e-4 relative) would otherwise enter KL at first order; renormalised it enters
    at second order (~1e-6 nats, far below any river's KL)."""

    def __init__(self, n: int, vocab: int):
        dt = np.float32 if n * vocab * 4 <= REF_BUDGET else np.float16
        self.rows = np.empty((n, vocab), dtype=dt)

    def __setitem__(self, i: int, lp: np.ndarray) -> None:
        self.rows[i] = lp

    def score(self, i: int, logits: np.ndarray) -> tuple[float, bool]:
        """(KL(backbone || this), top-1 agreement) at position i."""
        r = _log_softmax(self.rows[i])
        lp = _log_softmax(logits)
        return float(np.sum(np.exp(r) * (r - lp))), bool(np.argmax(r) == np.argmax(lp))


def _summary(kl: list[float], agree: list[bool], window: int) -> dict:
    k, a = np.asarray(kl, dtype=np.float64), np.asarray(agree, dtype=np.float64)
    q = max(len(k) // 4, 1)
    return {"kl": k.tolist(), "agree": [bool(x) for x in agree],
            "kl_mean": float(k.mean()), "agreement": float(a.mean()), "kl_max": float(k.max()),
            "windows": [{"start": s, "n": int(len(k[s:s + window])), "kl_mean": float(k[s:s + window].mean()),
                         "agreement": float(a[s:s + window].mean())} for s in range(0, len(k), window)],
            "kl_first_quarter": float(k[:q].mean()), "kl_last_quarter": float(k[-q:].mean())}


def _depth(hist: np.ndarray) -> float:
    """Mean backbone layers per step: hist[e + 1] counts exits after layer e; an empty one (backbone mode: the river
    off, no exit decided) is every layer (hist has n_layer + 1 entries)."""
    return F.mean_depth(hist, empty=len(hist) - 1)


def _open(river_path, n_ctx: int, threads: int, thresholds):
    from river_edge.runtime.llama import RiverLlama

    llm = RiverLlama(str(river_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=0,
                     thresholds=thresholds)
    if not llm.has_river:
        llm.close()
        raise RiverError(f"{river_path}: the runtime sees no river in it")
    return llm


def _backbone(llm, prompt: list[int], n: int, say: Progress, what: str):
    """Greedy backbone continuation of n tokens, EOS ignored (eval + argmax rather than generate(), which
    would stop there): (tokens, their log-probs, positions where the backbone chose EOS)."""
    llm.mode = "backbone"
    llm.reset()
    llm.eval(prompt)
    nxt = int(np.argmax(llm.last_logits()))
    ref, toks, eos = _Ref(n, llm.n_vocab()), [], []
    for i in range(n):
        if nxt == llm.token_eos():
            eos.append(i)
        toks.append(nxt)
        llm.eval([nxt])
        lg = llm.last_logits()
        ref[i] = _log_softmax(lg)
        nxt = int(np.argmax(lg))
        if i % 64 == 0:
            say(what, i, n)
    return toks, ref, eos


def _teacher_force(llm, mode: str, prompt: list[int], toks: list[int], ref: _Ref, say: Progress, what: str):
    """The mode over the backbone's tokens, one llama_decode each: (kl, agree, exit histogram, seconds).
    The prompt is prefilled in the same mode (one batch: the rule decides once for it), not scored."""
    llm.mode = mode
    llm.reset()
    llm.eval(prompt)
    llm.reset_stats()
    kl, agree, t0 = [], [], time.perf_counter()
    for i, t in enumerate(toks):
        llm.eval([t])
        k, a = ref.score(i, llm.last_logits())
        kl.append(k)
        agree.append(a)
        if i % 64 == 0:
            say(what, i, len(toks))
    return kl, agree, llm.exit_histogram(), time.perf_counter() - t0


def kl_along_sequence(river_path, modes: Sequence[str] = ("river", "fast"), *, prompt: str, n_tokens: int = 2048,
                      threads: int = 2, window: int = 256, thresholds: float | Sequence[float] | None = None,
                      progress: Progress | None = None) -> dict:
    """KL(backbone || mode) and agreement at each of n_tokens positions of one long backbone generation.

    thresholds: override the GGUF's for the river rule (None: the calibrated ones)."""
    from river_edge.tokenizer import Tokenizer

    say = progress or (lambda *a: None)
    bad = [m for m in modes if m not in STEP_MODES]
    if bad:
        raise RiverError(f"mode {bad[0]!r} cannot be teacher-forced: use {', '.join(STEP_MODES)}")
    ids = Tokenizer(river_path).chat(prompt)
    llm = _open(river_path, len(ids) + n_tokens + 8, threads, thresholds)
    try:
        t0 = time.perf_counter()
        toks, ref, eos = _backbone(llm, ids, n_tokens, say, "backbone text")
        out = {"model": Path(river_path).name, "n_layer": llm.n_layer, "n_tokens": n_tokens, "threads": threads,
               "host": host(threads),
               "prompt": prompt, "prompt_tokens": len(ids), "window": window,
               "ref_dtype": str(ref.rows.dtype), "backbone_seconds": time.perf_counter() - t0,
               "eos_positions": eos, "continuation": llm.detokenize(toks).decode(errors="replace"),
               "modes": {}}
        for m in modes:
            kl, agree, hist, sec = _teacher_force(llm, m, ids, toks, ref, say, m)
            out["modes"][m] = dict(_summary(kl, agree, window), mean_depth=_depth(hist),
                                   hist=hist.tolist(), seconds=sec)
        return out
    finally:
        llm.close()


def kl_in_batch(river_path, prompts: Sequence[str], *, n_tokens: int = 256, threads: int = 2, window: int = 64,
                thresholds: float | Sequence[float] | None = None, progress: Progress | None = None) -> dict:
    """The river rule on len(prompts) sequences decoded together (one llama_batch per step, one token per
    sequence) vs each alone, both teacher-forced on each prompt's greedy backbone continuation."""
    from llama_cpp._internals import LlamaBatch

    from river_edge.tokenizer import Tokenizer

    say = progress or (lambda *a: None)
    tk = Tokenizer(river_path)
    ids = [tk.chat(p) for p in prompts]
    n_seq, longest = len(ids), max(len(x) for x in ids)
    llm = _open(river_path, longest + n_tokens + 8, threads, thresholds)
    ctx = batch = None
    try:
        L = llm.n_layer
        refs, toks, seqs = [], [], []
        for s, p in enumerate(ids):
            t, r, eos = _backbone(llm, p, n_tokens, say, f"backbone text {s}")
            toks.append(t)
            refs.append(r)
            kl, agree, hist, sec = _teacher_force(llm, "river", p, t, r, say, f"river alone {s}")
            seqs.append({"prompt": prompts[s], "prompt_tokens": len(p), "eos_positions": eos,
                         "alone": dict(_summary(kl, agree, window), mean_depth=_depth(hist), hist=hist.tolist(),
                                       seconds=sec)})

        nb = max(longest, n_seq)
        ctx = batch_context(llm, n_seq, n_seq * (longest + n_tokens) + 64, nb)
        batch = LlamaBatch(n_tokens=nb, embd=0, n_seq_max=1, verbose=False)
        for s, p in enumerate(ids):  # prefill: one llama_decode (one ubatch, one rule decision) each, as alone
            batch.reset()
            batch.add_sequence(p, s, False)
            ctx.decode(batch)
        ctx.reset_stats()
        kl = [[] for _ in ids]
        agree = [[] for _ in ids]
        exits, t0 = [], time.perf_counter()
        b = batch.batch
        for i in range(n_tokens):
            b.n_tokens = n_seq
            for s in range(n_seq):
                b.token[s], b.pos[s], b.n_seq_id[s], b.logits[s] = toks[s][i], len(ids[s]) + i, 1, True
                b.seq_id[s][0] = s
            ctx.decode(batch)
            exits.append(ctx.last_exit)
            for s in range(n_seq):
                row = ctx.logits(s)
                k, a = refs[s].score(i, row)
                kl[s].append(k)
                agree[s].append(a)
            if i % 64 == 0:
                say("batch", i, n_tokens)
        sec = time.perf_counter() - t0
        hist = ctx.exit_histogram()
        for s in range(n_seq):
            seqs[s]["batch"] = _summary(kl[s], agree[s], window)

        def pooled(key: str, what: str) -> float:
            return float(np.mean([x for q in seqs for x in q[what][key]]))
        return {"model": Path(river_path).name, "n_layer": L, "n_tokens": n_tokens, "threads": threads,
                "host": host(threads),
                "n_seq": n_seq, "window": window, "ref_dtype": str(refs[0].rows.dtype),
                "thresholds": None if thresholds is None else llm.thresholds,
                "sequences": seqs, "batch_exits": exits, "batch_hist": hist.tolist(), "batch_seconds": sec,
                "batch_mean_depth": float(np.mean(exits)) + 1.0,
                "alone_mean_depth": float(np.mean([q["alone"]["mean_depth"] for q in seqs])),
                "batch_kl_mean": pooled("kl", "batch"), "alone_kl_mean": pooled("kl", "alone"),
                "batch_agreement": pooled("agree", "batch"), "alone_agreement": pooled("agree", "alone")}
    finally:
        if batch is not None:
            batch.close()
        if ctx is not None:
            ctx.close()  # before the model it was made on
        llm.close()
