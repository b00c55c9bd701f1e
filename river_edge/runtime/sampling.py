"""What exact mode computes on logits: llama.cpp's sampler chain as dense distributions (processed_probs,
Transform for the history-dependent parts), and sampling by position-keyed Gumbel noise (scores)."""
from __future__ import annotations

import math

import numpy as np


def _softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


class Transform:
    """What llama-cpp-python's sampler chain does to logits before choosing, for the parts that depend only on
    the history: its logits processors (logit_bias, min_tokens), then llama.cpp's penalties over the last
    `last_n` tokens *generated in this call* (the chain is new each call and accepts only sampled tokens).
    Applied to the backbone's rows (and the river's drafts) inside the speculative loop, row by row with the
    history that position has, so penalised decoding stays exact and fast."""

    def __init__(self, kw: dict, last_n: int):
        self.repeat = np.float32(kw.get("repeat_penalty", 1.0))
        self.freq = np.float32(kw.get("frequency_penalty", 0.0))
        self.present = np.float32(kw.get("presence_penalty", 0.0))
        self.last_n = max(int(last_n), 0)   # llama.cpp's penalties take a negative window as 0: off
        self.procs = list(kw.get("logits_processor") or [])
        self.penalties = bool(self.last_n != 0 and (self.repeat != 1 or self.freq != 0 or self.present != 0))

    def __bool__(self) -> bool:
        return self.penalties or bool(self.procs)

    def __call__(self, row: np.ndarray, ids, generated: list[int]) -> np.ndarray:
        """row: logits after the token ids[-1]; generated: the tokens sampled so far in this call."""
        x = np.array(row, dtype=np.float32)
        for proc in self.procs:
            x = np.asarray(proc(np.asarray(ids, dtype=np.intc), x), dtype=np.float32)
        window = generated[-self.last_n:] if self.last_n > 0 else generated
        if self.penalties and window:
            toks, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
            v = x[toks]
            v = np.where(v <= 0, v * self.repeat, v / self.repeat).astype(np.float32)
            c = counts.astype(np.float32)
            v = v - (c * self.freq + (c > 0).astype(np.float32) * self.present)
            x[toks] = v
        return x


def agree(drafts: list[int], top) -> int:
    """The accept step: how many drafts, in order, equal the verifier's choice at their position (its argmax, or
    with sampling the argmax of its scores); the cycle keeps them and the verifier's own token after them."""
    j = 0
    while j < len(drafts) and drafts[j] == top[j]:
        j += 1
    return j


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (numpy's array arithmetic wraps modulo 2^64, as the C original)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gumbel(seed: int, pos: int, ids: np.ndarray) -> np.ndarray:
    """Gumbel noise for the token ids at one position: a pure function of (seed, position, id), counter-based, so
    the noise a position gets never depends on how many draws came before it (draft lengths, timing, k)."""
    key = _mix(np.array([(int(seed) & 0xFFFFFFFF) << 32 | (int(pos) & 0xFFFFFFFF)], dtype=np.uint64))
    bits = _mix(key ^ _mix(np.asarray(ids, dtype=np.uint64)))
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53     # in (0, 1)
    return -np.log(-np.log(u))


def scores(p: np.ndarray, seed: int, pos: int) -> np.ndarray:
    """log p + Gumbel noise of (seed, pos) over p's support, -inf elsewhere: the token sampled at `pos` is the argmax
    (the Gumbel-max trick: an exact draw from p). Exact mode chooses drafts (from the river's q) and the backbone's
    tokens (from p) on the same noise, so a draft is kept exactly when the backbone, sampling with that noise, picks
    it too: every token is the backbone's own draw for (seed, position), whatever k was, and a seed gives one text."""
    out = np.full(p.shape[0], -np.inf)
    ids = np.nonzero(p)[0]
    out[ids] = np.log(p[ids]) + gumbel(seed, pos, ids)
    return out


def top1_prob(row: np.ndarray) -> float:
    """The softmax probability of the most likely token (float32: a draft's confidence, cheap enough per draft)."""
    x = np.asarray(row, dtype=np.float32)
    return float(1.0 / np.exp(x - x.max()).sum(dtype=np.float32))


def margin(row: np.ndarray, top: int | None = None) -> float:
    """Top-1 minus top-2 logit (0 for a shared maximum); `top`: the row's argmax when known. Two maxima of the
    slices around the top rather than a partition of the whole vocabulary: it is paid on every verified row."""
    i = int(row.argmax()) if top is None else int(top)
    return float(row[i] - max(row[:i].max(initial=-np.inf), row[i + 1:].max(initial=-np.inf)))


def row_entropy(logits: np.ndarray) -> float:
    x = logits.astype(np.float64)
    x = x - x.max()
    e = np.exp(x)
    s = e.sum()
    return float(math.log(s) - (e * x).sum() / s)


def processed_probs(logits: np.ndarray, temp: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution llama.cpp's chain (top_k, typical 1, top_p, min_p, temp, dist) samples from,
    dense over the vocabulary. temp < 0: dist alone (softmax of the raw logits)."""
    x = np.asarray(logits, dtype=np.float32)
    V = x.shape[0]
    if temp < 0:
        return _softmax64(x)
    if 0 < top_k < V:
        ids = np.argpartition(-x, top_k - 1)[:top_k]
    else:
        ids = np.arange(V)
    ids = ids[np.argsort(-x[ids], kind="stable")]          # descending, as llama.cpp's partial sort
    xs = x[ids]
    if top_p < 1.0:
        e = np.exp(xs - xs[0], dtype=np.float32)
        p = e / e.sum(dtype=np.float32)
        c = np.cumsum(p, dtype=np.float32)
        hit = np.nonzero(c >= np.float32(top_p))[0]
        last = int(hit[0]) + 1 if len(hit) else len(ids)
        ids, xs = ids[:last], xs[:last]
    if min_p > 0.0:
        keep = xs >= xs[0] + np.float32(math.log(min_p))
        keep[0] = True
        ids, xs = ids[keep], xs[keep]
    out = np.zeros(V, dtype=np.float64)
    out[ids] = _softmax64(xs / np.float32(temp))
    return out


