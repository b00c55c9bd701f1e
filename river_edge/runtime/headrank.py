"""The trimmed head's ranking (headdraft.py): the vocabulary ordered by what the model itself writes.

Ranked by the model's own greedy answers to the packaged prompts (their tokens count 4), then the prompts' own tokens
(1), then the rest by the vocabulary's scores and ids: FR-Spec's "tokens the model emits most", measured on the model
rather than assumed from token ids (on Gemma 3, a tenth of the argmaxes of its own text sit near id 236,800). Built
in seconds (a time budget bounds the generation). `river build` stores it in the river GGUF (river.head_ranking); for
any other file it is kept in a sidecar under the cache, keyed by the file's hash: the input model is never modified.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import time
from pathlib import Path

import llama_cpp
import numpy as np

from river_edge import zoo
from river_edge.calibration.prompts import default_prompts
from river_edge.gguf_tools.inspect import head_ranking

N_PROMPTS = 16
N_TOKENS = 48
BUDGET_S = 20.0


def file_hash(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:20]


def sidecar(path) -> Path:
    return zoo.cache_dir() / "heads" / f"{file_hash(path)}.npy"


def load_or_build(llm) -> np.ndarray:
    """The model file's ranking: the one its river GGUF stores, else its sidecar's, else built now and saved to the
    sidecar (atomically: a temporary file renamed)."""
    n_vocab = llm.decoder.n_vocab
    if getattr(llm, "has_river", False) and (r := head_ranking(llm.model_path)) is not None and len(r) == n_vocab:
        return r
    side = sidecar(llm.model_path)
    if side.exists():
        try:
            r = np.load(side, allow_pickle=False)
            if r.dtype == np.int32 and r.ndim == 1 and len(r) == n_vocab and len(np.unique(r)) == n_vocab:
                return r
        except (OSError, ValueError):
            pass   # a damaged sidecar is rebuilt
    r = rank(llm)
    side.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=side.parent, suffix=".npy.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, r)
        os.replace(tmp, side)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return r


def chat_tokens(llm, prompt: str) -> list[int]:
    """The prompt in the model's chat template (as `river chat` sends it), else as plain text."""
    model = llm._model.model
    tmpl = llama_cpp.llama_model_chat_template(model, None)
    text = prompt
    if tmpl:
        msg = (llama_cpp.llama_chat_message * 1)(llama_cpp.llama_chat_message(b"user", prompt.encode()))
        buf = ctypes.create_string_buffer(8 * len(prompt) + 4096)
        n = llama_cpp.llama_chat_apply_template(tmpl, msg, 1, True, buf, len(buf))
        if 0 < n <= len(buf):
            text = buf.raw[:n].decode("utf-8", errors="replace")
    return llm.tokenize(text.encode(), add_bos=True, special=True)


def rank(llm, n_prompts: int = N_PROMPTS, n_tokens: int = N_TOKENS, budget_s: float = BUDGET_S) -> np.ndarray:
    """Every vocabulary id, most emitted first. Decodes on the model's own context (sequence 0, then cleared)."""
    dec = llm.decoder
    counts = np.zeros(dec.n_vocab, dtype=np.float64)
    t_end = time.perf_counter() + budget_s
    ps = default_prompts()   # GSM8K questions, then code requests: every few of each
    for p in ps[::max(1, len(ps) // n_prompts)][:n_prompts]:
        toks = chat_tokens(llm, p)[: llm.n_ctx() - n_tokens]
        np.add.at(counts, toks, 1.0)
        if time.perf_counter() > t_end:
            continue
        dec.cut(0)
        for i in range(0, len(toks), llm.n_batch):
            row = dec.decode(toks[i:i + llm.n_batch], i)[0]
        pos = len(toks)
        for _ in range(n_tokens):
            tok = int(row.argmax())
            counts[tok] += 4.0
            if dec.is_eog(tok):
                break
            row = dec.decode([tok], pos)[0]
            pos += 1
    dec.cut(0)            # the prompt cache no longer holds what its tokens say
    dec.logits_stale()
    vocab = llm._model.vocab
    score = np.array([llama_cpp.llama_vocab_get_score(vocab, i) for i in range(dec.n_vocab)], dtype=np.float64)
    ids = np.arange(dec.n_vocab)
    return np.lexsort((ids, -score, -counts)).astype(np.int32)
