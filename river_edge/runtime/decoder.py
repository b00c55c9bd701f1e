"""The model as the decoding modes see it (spec.py, exact.py, gated.py, costs.py, a draft model): one sequence of
cells and the tokens they hold.

Decode tokens at a position and read their logits, remove scratch cells from a position on, keep or cut the
sequence (`accept`, `cut`: the tokens and their cells move together), force the river's exit for the next decodes,
and switch the decode threads; plus the few things of llama-cpp-python's Llama that its own generate() shares with
the modes (the sampler, the seed, whether the context's logits are stale). RiverLlama holds one (`llm.decoder`), a
draft model another; the modes reach the model only through it, and tests drive them through it too. This is the
one place that touches llama-cpp-python's private state, and the one that writes `n_tokens` and `input_ids`.
"""
from __future__ import annotations

import ctypes
import weakref

import llama_cpp
import numpy as np

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.settings import SETTINGS


class Decoder:
    """Sequence 0 of a Llama's context (a RiverLlama's, or a stock one's for a draft model)."""

    def __init__(self, llm):
        self._llm = weakref.ref(llm)   # the model owns its decoder, not the other way round
        self.n_vocab = int(llm._n_vocab)
        self.n_layer = int(llama_cpp.llama_model_n_layer(llm._model.model))
        self.n_embd = int(llama_cpp.llama_model_n_embd(llm._model.model))
        self.has_river = bool(getattr(llm, "has_river", False))   # a plain GGUF's graph has no exit to force

    @property
    def llm(self):
        return self._llm()

    def fit_context(self) -> None:
        """Token (and logits_all) arrays as long as the context llama.cpp made: it rounds n_ctx up (to a multiple of
        256) and decodes that far, while llama-cpp-python sized its arrays by the request, so the last positions had
        nowhere to go."""
        llm = self.llm
        if len(llm.input_ids) < llm._n_ctx:
            llm.input_ids = np.zeros(llm._n_ctx, dtype=np.intc)
            if llm._logits_all:
                llm.scores = np.zeros((llm._n_ctx, self.n_vocab), dtype=np.single)

    # -- cells -----------------------------------------------------------------------------------
    def decode(self, toks, pos: int, all_logits: bool = False) -> np.ndarray:
        """Decode toks at positions pos.. of sequence 0; their logits rows (all of them, else the last one's) as
        a view: copy before the next decode."""
        llm = self.llm
        llm._batch.set_batch(batch=toks, n_past=pos, logits_all=all_logits)
        llm._ctx.decode(llm._batch)
        n = len(toks) if all_logits else 1
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n, self.n_vocab))

    @property
    def n_ctx(self) -> int:
        return self.llm.n_ctx()

    @property
    def n_batch(self) -> int:
        return self.llm.n_batch

    @property
    def verify_invariant(self) -> bool:
        """Verification batches run on ggml's reference kernels (RiverLlama.verify_invariant; a stock model: no)."""
        return bool(getattr(self.llm, "verify_invariant", False))

    def verify(self, toks, pos: int, invariant: bool | None = None) -> np.ndarray:
        """Decode a verification batch at positions pos..: every row's logits (a view). `invariant` (by default the
        model's `verify_invariant`): this batch alone runs on ggml's reference kernels (patches/0013), so each row gets
        the bits of decoding it alone; the prompt and one-token steps keep the stock kernels."""
        if invariant is None:
            invariant = self.verify_invariant
        if not invariant:
            return self.decode(toks, pos, True)
        llm = self.llm
        llm._river.llama_set_batch_invariant(llm._ctx.ctx, True)
        try:
            return self.decode(toks, pos, True)
        finally:
            llm._river.llama_set_batch_invariant(llm._ctx.ctx, False)

    # -- the LM head (patches/0017: head drafting) --------------------------------------------------
    def set_head_rows(self, ids) -> int:
        """Every later decode's logits from these vocabulary rows of the LM head only (-inf elsewhere); empty: the
        whole head. 0, or the runtime's error code (LLAMA_RIVER_ERR_HEAD: this head cannot be trimmed)."""
        llm = self.llm
        a = np.ascontiguousarray(ids, dtype=np.int32)
        return int(llm._river.llama_head_set_rows(llm._ctx.ctx, a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                                  len(a)))

    def n_head_rows(self) -> int:
        """Rows of the trimmed head now set (0: the whole head)."""
        llm = self.llm
        return int(llm._river.llama_head_get_n_rows(llm._ctx.ctx))

    def keep_hidden(self, on: bool) -> None:
        """Keep each decoded token's head input (the output norm's row) readable by hidden(): llama.cpp's
        embeddings output, without pooling. Not for the prompt: with it on every prompt row is an output."""
        llama_cpp.llama_set_embeddings(self.llm._ctx.ctx, on)

    def hidden(self) -> np.ndarray:
        """The last decoded token's head input (a copy)."""
        llm = self.llm
        p = llama_cpp.llama_get_embeddings_ith(llm._ctx.ctx, -1)
        return np.array(np.ctypeslib.as_array(p, shape=(self.n_embd,)))

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """The full LM head over rows of head inputs, each row with a one-token decode's bits (patches/0017)."""
        llm = self.llm
        h = np.ascontiguousarray(h, dtype=np.float32)
        out = np.empty((len(h), self.n_vocab), dtype=np.float32)
        f = ctypes.POINTER(ctypes.c_float)
        r = llm._river.llama_head_logits(llm._ctx.ctx, h.ctypes.data_as(f), len(h), out.ctypes.data_as(f))
        if r != len(h):
            raise RuntimeError(f"llama_head_logits failed ({r})")
        return out

    def remove(self, p0: int) -> None:
        """Remove sequence 0's cells from position p0 on (sequence 0 only: the one generate() decodes): scratch
        cells past the kept tokens (drafts, a batch being settled); `cut` moves the kept tokens too."""
        self.llm._ctx.kv_cache_seq_rm(0, p0, -1)

    # -- the kept sequence: tokens and cells together ------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return self.llm.n_tokens

    def history(self, n: int | None = None) -> np.ndarray:
        """The first n kept tokens (all of them by default), as a view: llama-cpp-python's `_input_ids`."""
        llm = self.llm
        return llm.input_ids[:llm.n_tokens if n is None else n]

    def accept(self, tokens, at: int) -> None:
        """The tokens decoded at positions at.. are kept: the context holds them, and no cell past them."""
        llm, end = self.llm, at + len(tokens)
        llm.input_ids[at:end] = tokens
        llm.n_tokens = end
        self.remove(end)

    def cut(self, n: int) -> None:
        """Keep the first n tokens and their cells alone."""
        self.llm.n_tokens = n
        self.remove(n)

    def clear(self) -> None:
        """No tokens, and no cells in any sequence (the cache's contract changed: RiverLlama._sync_cache)."""
        self.llm.n_tokens = 0
        self.llm._ctx.kv_cache_clear()

    def prefill(self, tokens: list[int], reset: bool) -> np.ndarray:
        """Evaluate the prompt on the backbone exactly as backbone mode (Llama.generate) does: the cached prefix
        reused up to the last prompt token, the rest by Llama.eval's n_batch chunks (each chunk's last logits). On
        sequence 0 alone: eval clears every sequence's cells past n_tokens. Returns the logits of the last prompt
        position (a copy); n_tokens is then the first free position."""
        llm = self.llm
        self.logits_stale()   # the context's last logits will be whichever row a mode decoded last
        keep = 0
        if reset and llm.n_tokens > 0:
            for a, b in zip(self.history(), tokens[:-1]):
                if a != b:
                    break
                keep += 1
        elif not reset:
            keep = llm.n_tokens
            tokens = list(self.history()) + tokens
        if len(tokens) > llm.n_ctx():
            raise RiverError(f"prompt of {len(tokens)} tokens does not fit the context of {llm.n_ctx()}")
        self.cut(keep)
        self.force_exit(self.n_layer - 1)
        rest = tokens[keep:]
        for i in range(0, len(rest), llm.n_batch):
            chunk = rest[i:i + llm.n_batch]
            row = self.decode(chunk, llm.n_tokens)[0]
            self.accept(chunk, llm.n_tokens)
        return np.array(row)

    # -- the river's exit ---------------------------------------------------------------------------
    def force_exit(self, e: int | None) -> None:
        """The exit for the next decodes (None: the rule, as `decide` says; -1: all river; n_layer - 1: the backbone),
        the KV cache kept as it is: the one check of a forced exit (RiverLlama's `force_exit` and `forced_exit` come
        here). A model without a river has no exit to force."""
        if not self.has_river:
            return
        llm = self.llm
        e = SETTINGS["forced_exit"](e, self.n_layer)
        rule = F.EXIT_LAGGED if getattr(llm, "_decide", "sync") == "lagged" else F.EXIT_RULE
        if llm._river.llama_river_set_forced_exit(llm._ctx.ctx, rule if e is None else e) != 0:
            raise RiverError(f"llama.cpp refused forced exit layer {e}")

    def stored_gate(self) -> float:
        """river.gate_entropy as the loader read it (NaN: none; a bad key was refused at load)."""
        llm = self.llm
        return float(llm._river.llama_model_river_gate(llm._model.model))

    def enable_river(self, on: bool = True) -> None:
        llm = self.llm
        llm._river.llama_river_set_enabled(llm._ctx.ctx, on)

    def decode_threads(self, on: bool) -> None:
        """Drafts and verification batches are decoding, so they run on the decode threads. llama.cpp gives any
        batch of 2+ tokens n_threads_batch (meant for prefill: llama-cpp-python's default is every core); on a busy
        machine those extra spinning threads made each verification hundreds of times slower, and the cost model
        then never drafted again. Off: the context's own setting back, for the next prompt."""
        llm = self.llm
        cp = llm.context_params
        llama_cpp.llama_set_n_threads(llm._ctx.ctx, cp.n_threads, cp.n_threads if on else cp.n_threads_batch)

    def last_logits(self) -> np.ndarray:
        """The context's logits of the last token decoded (a copy)."""
        return np.array(np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,)))

    # -- what Llama.generate() shares with the modes ----------------------------------------------
    def logits_stale(self) -> None:
        """The context's last logits are no longer the last token's (a mode decoded other rows since): Llama's
        generate must decode again, not sample from them, on an exact prompt-cache hit."""
        self.llm._requires_eval = True

    @property
    def logits_all(self) -> bool:
        return bool(self.llm._logits_all)

    @property
    def seed(self) -> int:
        """The context's sampling seed as llama.cpp takes it: a uint32 (-1 is 0xFFFFFFFF)."""
        return int(self.llm._seed) & 0xFFFFFFFF

    def sampler(self, **kw):
        """llama.cpp's own sampler chain, as Llama.generate builds it from these settings."""
        return self.llm._init_sampler(**kw)

    def sample(self, sampler) -> int:
        """A token from the last decoded row, by `sampler`."""
        return sampler.sample(self.llm._ctx, -1)

    def is_eog(self, tok: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, int(tok)))

    def token_text(self, tok: int) -> bytes:
        return self.llm._model.token_get_text(int(tok))

    def setup(self) -> tuple:
        """What changes a step's cost or a batch row's arithmetic: threads, batch sizes, K/V types, flash
        attention, offload, where the weights sit."""
        llm = self.llm
        cp, mp = llm.context_params, llm.model_params
        setup = tuple(getattr(cp, f) for f in ("n_threads", "n_threads_batch", "n_batch", "n_ubatch", "type_k",
                                              "type_v", "flash_attn_type", "offload_kqv", "op_offload", "swa_full"))
        return setup + tuple(getattr(mp, f) for f in ("n_gpu_layers", "split_mode", "main_gpu"))
