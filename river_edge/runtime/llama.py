"""River GGUFs in the patched llama.cpp, through llama-cpp-python.

`RiverLlama` is a `llama_cpp.Llama`: completions, chat completions, streaming and llama-cpp-python's
OpenAI-compatible server work unchanged, plus the river controls and telemetry of patches/0001 (llama.h).
The C API is bound in river_edge/runtime/capi.py, through llama_cpp's own loaded library.
"""
from __future__ import annotations

import contextlib
import ctypes
import warnings
from pathlib import Path
from typing import Sequence

import llama_cpp
import numpy as np
from jinja2 import TemplateError

from river_edge import format as F
from river_edge.format import RiverError, RiverWarning
from river_edge.runtime.capi import (_lib, batch_departing, exit_histogram_of, has_river_tensors, model_params,
                                    offloaded_to_device, tensor_buft)
from river_edge.runtime.decoder import Decoder
from river_edge.runtime.inputs import check_grammar, check_tokens, token_cap
from river_edge.runtime.rpc import connect
from river_edge.runtime.spec import Spec  # decoding modes (river_edge/runtime/spec.py)
from river_edge.settings import SETTINGS as S
from river_edge.tokenizer import quiet_llama_logs


class RiverLlama(llama_cpp.Llama):
    """A llama_cpp.Llama on a river GGUF (or any GGUF: without a river it is the stock model).

    Keyword arguments are Llama's, plus the river settings (settings.py declares each: default, bound, help):
    `thresholds`, `min_exit_layer` and `forced_exit` over the GGUF's river keys, `mode`, `gate`, `decide` and
    `drafter`; and `river=False` to run the stock graph, `river_head=False` to draft with the backbone's LM head,
    `extra_bufts=False` to keep every weight out of ggml's extra buffer types (AMX, CPU_REPACK), `batch_invariant`,
    and `rpc_servers="host:port,..."` to offload layers (rpc.py)."""

    def __new__(cls, model_path: str, *args, **kwargs):
        # Checked before the object exists: a half-made Llama fails again in its __del__.
        path = Path(model_path)
        if not path.is_file():
            raise RiverError(f"{path}: no such file")
        S["decide"](kwargs.get("decide", S["decide"].default))
        F.check_count(kwargs.get("n_ctx", 512), "n_ctx", 0, F.MAX_CTX)   # 0: the model's training context
        for k in [k for k in ("n_threads", "n_threads_batch") if kwargs.get(k) is not None]:
            F.check_count(kwargs[k], k, 1, F.MAX_THREADS)
        if _lib() is None and has_river_tensors(path):
            raise RiverError(f"{path} is a river GGUF: it needs river-edge's patched llama-cpp-python "
                             "(run `make setup`); this one is stock")
        if kwargs.get("rpc_servers"):
            try:
                connect(kwargs["rpc_servers"])
            except ValueError as e:   # a malformed endpoint list
                raise RiverError(str(e)) from None
        return super().__new__(cls)

    def __init__(self, model_path: str, *, thresholds: float | Sequence[float] | None = None,
                 min_exit_layer: int | None = None, forced_exit: int | None = None, river: bool = True,
                 river_head: bool = True, mode: str | None = None, gate: float | None = None,
                 drafter: str | None = None, extra_bufts: bool = True, rpc_servers=None,
                 decide: str = S["decide"].default, batch_invariant: bool | None = None, **kwargs):
        path = Path(model_path)
        self._decide = decide   # checked in __new__, before the Llama exists
        self._invariant = True if batch_invariant is None else bool(batch_invariant)
        self._extra_bufts, self._rpc_servers = bool(extra_bufts), kwargs.get("rpc_servers")
        self._river = _lib()   # rpc_servers: connected in __new__
        kwargs.setdefault("verbose", False)
        # A sliding-window layer's cache (Gemma 3) otherwise keeps only the window: cells that a rejected draft,
        # or a prompt-cache cut, pushed out of it would be gone when the cache is cut back (llama.cpp's own
        # speculative decoding needs the same). No effect on a model without sliding-window layers.
        kwargs.setdefault("swa_full", True)

        with quiet_llama_logs() if not kwargs["verbose"] else contextlib.nullcontext([]) as log:
            try:
                with model_params(use_extra_bufts=bool(extra_bufts)):
                    super().__init__(str(path), **kwargs)
            except ValueError as e:
                why = [x for x in "".join(log).splitlines() if "fail" in x or "error" in x] or [str(e)]
                raise RiverError(f"{path}: llama.cpp cannot load it ({why[0].strip()})") from None
            except TemplateError as e:   # llama-cpp-python compiles the GGUF's chat template when it loads
                raise RiverError(f"{path}: its chat template (tokenizer.chat_template) does not parse: {e}") from None
        if kwargs.get("chat_format") is None and "tokenizer.chat_template" not in self.metadata \
                and self.metadata.get("general.architecture") == "gemma3":   # (the 270M's GGUF has no template)
            self.chat_format = "gemma"   # Gemma's turns, not llama-cpp-python's fallback (llama-2's [INST])
        self.n_layer = int(llama_cpp.llama_model_n_layer(self._model.model))
        self.has_river = bool(self._river and self._river.llama_model_has_river(self._model.model))

        self.decoder = Decoder(self)   # the model as the decoding modes see it (decoder.py)
        self.decoder.fit_context()
        # the mode first (it sets the forced exit: the runtime's own default is the backbone), then the
        # settings over it; `mode` wins over `forced_exit`. `decoding`: the decoding modes' machinery, whose options
        # (draft_k, draft_stop, draft_log, cost_model, kmax) tests and benchmarks set
        self.decoding = Spec(self, mode, gate)
        if thresholds is not None:
            self.thresholds = thresholds
        if min_exit_layer is not None:
            self.min_exit_layer = min_exit_layer
        if forced_exit is not None and mode is None:
            self.forced_exit = forced_exit
        if not river:
            self.river_enabled = False
        if not river_head and self.has_river_head:
            self.river_head = False
        if drafter is not None:
            self.drafter = drafter
        self._departing = batch_departing(self, path, kwargs.get("n_gpu_layers"))
        self._cache_contract = self._contract()
        if kwargs.get("n_gpu_layers") and self.offloaded is False:
            # llama.cpp keeps every layer on the host without a word when no device can take them
            warnings.warn(f"n_gpu_layers={kwargs['n_gpu_layers']} offloaded nothing: this llama-cpp-python found no GPU "
                          "it can use (and no rpc_servers were given), so every layer runs on the CPU",
                          RiverWarning, stacklevel=2)

    # -- the KV cache's contract ---------------------------------------------------------------
    def _contract(self) -> tuple:
        """What wrote the cells now in the KV cache, as far as it decides later tokens: cells written under another
        contract (river K/V under a backbone mode, another rule's exits, other arithmetic) must not be reused. Backbone
        mode writes the stock runtime's cells, and so does exact mode while its verification rows are invariant."""
        stock = ("backbone", self.decoding.mode != "exact" or self.exact_batch != 1)
        if not self.has_river or not self.river_enabled:
            return stock
        mode = self.decoding.mode
        if mode in F.LOSSLESS_MODES:
            return stock
        if mode == "gated":
            return ("gated", self.decoding.gate, self.river_head)
        e = self.forced_exit
        if e is None:
            return ("rule", tuple(self.thresholds), self.min_exit_layer, self._decide)
        if e == self.n_layer - 1:
            return stock
        return ("forced", e, self.river_head if e == -1 else None)

    def _sync_cache(self) -> None:
        """Drop the KV cache when the contract it was written under no longer holds."""
        if not hasattr(self, "_cache_contract"):
            return  # still in __init__: nothing decoded yet
        c = self._contract()
        if c != self._cache_contract:
            self._cache_contract = c
            self.decoder.clear()

    # -- batch invariance (patches/0013) ---------------------------------------------------------
    @property
    def batch_invariant(self) -> bool:
        """Whether exact mode's verification batches give every row the bits of decoding it alone (logits and K/V): they
        run on ggml's reference kernels, one vec_dot per output as a lone row takes (patches/0013); the prompt and
        one-token steps keep the stock kernels, so exact mode writes the stock runtime's text by construction. On by
        default (`batch_invariant=False` lets batches take the batched kernels, the near-tie guard deciding); False
        wherever rows depart anyway (`departing`)."""
        return bool(self._river) and self._invariant and not self._departing

    @property
    def verify_invariant(self) -> bool:
        """Verification batches on the reference kernels: as asked, even where rows depart (exact up to exact_batch)."""
        return bool(self._river) and self._invariant

    @property
    def departing(self) -> list[str]:
        """Why verification rows depart from one-token rows though batch invariance is asked for: weights in a repacked
        layout whose batched kernel rounds otherwise (by name), flash attention over 512 cells or more, a device."""
        return list(self._departing)

    @property
    def exact_batch(self) -> int | None:
        """The largest verification batch whose rows are one-token rows bit for bit: None, any (batch_invariant); 3
        where only repacked weights depart (ggml's repacked matmuls take a 4-row kernel from 4 rows, a lone row's
        below); 1, none (invariance off, flash attention over 512 cells, a device: the near-tie guard decides)."""
        if self.batch_invariant:
            return None
        return 3 if self.verify_invariant and all(d.startswith("blk.") for d in self._departing) else 1

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._invariant = bool(on)
        self._sync_cache()

    # -- decoding modes: exact, gated, river, fast, backbone (river_edge/runtime/spec.py) ---------------
    @property
    def mode(self) -> str:
        return self.decoding.mode

    @mode.setter
    def mode(self, m: str) -> None:
        self.decoding.mode = m
        self._sync_cache()   # once, under the new mode: e.g. river K/V left by fast mode must not feed exact mode

    @property
    def gate(self) -> float:
        """The gated mode's entropy gate (nats): the backbone re-decodes a position at river entropy >= gate."""
        return self.decoding.gate

    @gate.setter
    def gate(self, g: float) -> None:
        self.decoding.gate = g   # (checked there)
        self._sync_cache()

    @property
    def drafter(self) -> str:
        """Who drafts in exact mode: river, ngram, river+ngram, or the path of a separate draft model."""
        return self.decoding.drafter

    @drafter.setter
    def drafter(self, d) -> None:
        self.decoding.drafter = d

    def generate(self, tokens, **kw):
        check_tokens(tokens, self._n_vocab, "tokens")
        if kw.get("grammar") is not None:
            check_grammar(self, kw["grammar"]._grammar)
        self._sync_cache()
        return self.decoding.generate(tokens, super().generate, kw)

    def _create_completion(self, *args, **kw):
        kw["stopping_criteria"] = token_cap(kw.get("max_tokens", 16), kw.get("stopping_criteria"))
        return super()._create_completion(*args, **kw)

    def end_streams(self) -> None:
        """Close the streams callers left open, now rather than whenever the garbage collector gets to them (a late
        close is harmless: a stream's cleanup touches the model only while no later call has taken it)."""
        self.decoding.end_streams()

    # A saved state (set_cache's prompt caches) carries its K/V's contract; another's is not loaded (decoded afresh)
    def save_state(self):
        self._sync_cache()
        state = super().save_state()
        state.river_contract = self._cache_contract
        return state

    def load_state(self, state) -> None:
        self._sync_cache()
        if getattr(state, "river_contract", None) == self._cache_contract:
            super().load_state(state)

    def detokenize(self, tokens, *args, **kw) -> bytes:
        # llama.cpp aborts the process (std::out_of_range) on an id outside the vocabulary
        check_tokens(tokens, self._n_vocab, "tokens")
        return super().detokenize(tokens, *args, **kw)

    def close(self) -> None:
        if getattr(self, "decoding", None) is not None:
            self.decoding.close_draft()
        super().close()

    def stats(self) -> dict:
        """Telemetry of the decoding mode since it was set: tokens, tok/s, acceptance rate, mean draft
        length and cost model (exact), fallback rate (gated); the latest call's first-to-last-token seconds."""
        return self.decoding.stats()

    @property
    def extra_bufts(self) -> bool:
        """Weights may sit in ggml's extra buffer types (AMX, CPU_REPACK), as loaded."""
        return self._extra_bufts

    @property
    def rpc_servers(self) -> str | None:
        return self._rpc_servers

    def tensor_buft(self, name: str) -> str | None:
        """The ggml buffer type holding a weight of this model (see `tensor_buft`)."""
        return tensor_buft(self, name)

    @property
    def offloaded(self) -> bool | None:
        """Whether the last backbone layer sits on a device (a GPU or an rpc-server): n_gpu_layers offloads the
        last layers first, so False means nothing was offloaded. None on a stock runtime (it cannot tell)."""
        return offloaded_to_device(self)

    def last_logits(self) -> np.ndarray:
        """Logits of the last token decoded (a copy). Llama.scores holds them only with logits_all=True."""
        return self.decoder.last_logits()

    # -- controls ------------------------------------------------------------------------------
    def _need_river(self):
        if not self.has_river:
            raise RiverError(f"{self.model_path}: has no river tensors; build one with `river build`")
        return self._river, self._ctx.ctx

    @property
    def river_enabled(self) -> bool:
        return self.has_river and bool(self._river.llama_river_get_enabled(self._ctx.ctx))

    @river_enabled.setter
    def river_enabled(self, on: bool) -> None:
        if self.has_river:
            self._river.llama_river_set_enabled(self._ctx.ctx, bool(on))
        elif on:
            self._need_river()
        self._sync_cache()

    @property
    def thresholds(self) -> list[float]:
        lib, ctx = self._need_river()
        buf = (ctypes.c_float * self.n_layer)()
        lib.llama_river_get_thresholds(ctx, buf, self.n_layer)
        return list(buf)

    @thresholds.setter
    def thresholds(self, tau: float | Sequence[float]) -> None:
        lib, ctx = self._need_river()
        tau = S["thresholds"](tau, self.n_layer)
        if lib.llama_river_set_thresholds(ctx, (ctypes.c_float * len(tau))(*tau), len(tau)) != 0:
            raise RiverError("llama.cpp refused the thresholds")
        self._sync_cache()

    @property
    def min_exit_layer(self) -> int:
        lib, ctx = self._need_river()
        return int(lib.llama_river_get_min_exit_layer(ctx))

    @min_exit_layer.setter
    def min_exit_layer(self, layer: int) -> None:
        lib, ctx = self._need_river()
        if lib.llama_river_set_min_exit_layer(ctx, S["min_exit_layer"](layer, self.n_layer)) != 0:
            raise RiverError(f"llama.cpp refused min exit layer {layer}")
        self._sync_cache()

    @property
    def forced_exit(self) -> int | None:
        """None: the rule decides; -1: all river; e: backbone 0..e, river after; n_layer-1: backbone."""
        lib, ctx = self._need_river()
        e = int(lib.llama_river_get_forced_exit(ctx))
        return None if e in (F.EXIT_RULE, F.EXIT_LAGGED) else e

    @forced_exit.setter
    def forced_exit(self, e: int | None) -> None:
        self.force_exit(e)
        self._sync_cache()

    def force_exit(self, e: int | None) -> None:
        """Set the forced exit for the next decodes and keep the KV cache as it is: for measurements that
        mix writers on purpose (teacher-forced random exits, a gated fallback). The `forced_exit` setter
        drops cells written under another exit instead. Checked once, by the decoder."""
        self._need_river()
        self.decoder.force_exit(e)

    @property
    def decide(self) -> str:
        """How the rule decides: "sync" (the paper's rule: each checked layer's score read back as it finishes)
        or "lagged" (the exit fixed before a step from the previous step's scores, the river's past its exit,
        read once after it: no sync inside the graph). The first step after setting it runs the backbone."""
        return self._decide

    @decide.setter
    def decide(self, d: str) -> None:
        self._decide = S["decide"](d)
        if self.has_river and self.forced_exit is None:
            self.forced_exit = None   # the rule again, under the new decision

    @property
    def has_river_head(self) -> bool:
        """The GGUF holds a river LM head (river.output.weight)."""
        return self.has_river and int(self._river.llama_river_get_head(self._ctx.ctx)) >= 0

    @property
    def river_head(self) -> bool:
        """All-river steps (drafts, fast mode) use the river LM head."""
        lib, ctx = self._need_river()
        return int(lib.llama_river_get_head(ctx)) == 1

    @river_head.setter
    def river_head(self, on: bool) -> None:
        lib, ctx = self._need_river()
        if lib.llama_river_set_head(ctx, bool(on)) != 0:
            raise RiverError(f"{self.model_path}: has no river LM head (river.output.weight); rebuild with `river build`")
        self._sync_cache()

    # -- telemetry -----------------------------------------------------------------------------
    @property
    def last_exit(self) -> int | None:
        """Exit layer of the last ubatch (-1..n_layer-1), None if none ran the river graph."""
        lib, ctx = self._need_river()
        e = int(lib.llama_river_last_exit(ctx))
        return None if e == F.EXIT_NONE else e

    def exit_histogram(self) -> np.ndarray:
        """counts[e + 1]: ubatches that exited after layer e, e = -1..n_layer-1."""
        return exit_histogram_of(*self._need_river(), self.n_layer)

    def last_scores(self) -> np.ndarray:
        """s_l of the last ubatch (min over its tokens) for the layers tested, NaN elsewhere."""
        lib, ctx = self._need_river()
        buf = (ctypes.c_float * self.n_layer)()
        lib.llama_river_get_last_scores(ctx, buf, self.n_layer)
        return np.array(buf, dtype=np.float32)

    def mean_depth(self) -> float:
        """Mean backbone layers per ubatch since the last reset (n_layer: pure backbone; the river off counts none)."""
        return F.mean_depth(self.exit_histogram(), empty=0.0 if self.river_enabled else self.n_layer)

    def decision_seconds(self) -> float:
        lib, ctx = self._need_river()
        return lib.llama_river_decision_us(ctx) * 1e-6

    def reset_stats(self) -> None:
        self.decoding.reset_stats()   # and a river GGUF's exit telemetry
        if self.has_river:
            self._river.llama_river_reset_stats(self._ctx.ctx)
