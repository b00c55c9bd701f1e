"""River-Spec: decoding modes of a river GGUF (exact self-speculation, entropy-gated fast path).

Modes (`RiverLlama(mode=...)`, or `llm.mode = ...`):
  backbone  the river off: the backbone alone, on the stock graph (the benchmarks' and `river eval`'s baseline)
  fast      forced exit -1: the river alone (all layers 4-bit, the backbone's embeddings, the river's LM
            head if the GGUF has one, else the backbone's)
  river     the paper's cosine rule (forced exit: none); the default for a river GGUF
  exact     a drafter (the river by default) drafts k tokens, the backbone re-decodes the k+1 positions in one
            batch, and the longest prefix the backbone agrees with is kept plus the backbone's own next token.
            Output = backbone's (exact.py: the loop and why it is exact).
  gated     every token on the river; when the river's output entropy >= the gate (GGUF key
            river.gate_entropy, or `gate=`), the backbone re-decodes that position and its token wins (gated.py).

Why a generate() override and not a llama_cpp.LlamaDraftModel: a draft model makes llama-cpp-python
set logits_all, copy every position's logits (152k floats per token on Qwen) into an n_ctx x n_vocab
array, and accept a draft only when an independently *sampled* backbone token equals it (exact in
distribution for temperature > 0, but the two draws are independent, so with sampling it wastes most
drafts). Owning the loop gives coupled sampling (the draft and the backbone's draw share their noise),
the acceptance statistics the cost model needs, and no per-token copies. Every other path of llama-cpp-
python (create_completion, chat, streaming, the server) goes through generate(), so they all get it.

Not speculated: typical_p != 1, mirostat, grammar, logits_all (logprobs), a llama-cpp-python draft_model: exact
mode then decodes on the backbone alone with llama.cpp's own sampler (still exact, no speed-up) and
stats()["spec_off"] says why. A seed is taken as llama.cpp takes it (a uint32; -1 is a random seed), a negative
last_n_tokens_size as 0 (penalties off).

Drafters (drafters.py): the river by default; prompt lookup ("ngram", "ngram-cache"), "river+ngram", or a separate
draft model (`llm.drafter = "draft.gguf"`), all through one loop, so exactness holds for each alike. The costs k is
chosen by are measured on this machine on first use (per process, per model file and thread count) and kept current
from the timings of the cycles themselves (costs.py).
"""
from __future__ import annotations

import math
import secrets
import time
import warnings
import weakref
from dataclasses import dataclass, field

import llama_cpp

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.runtime.capi import runtime_is_patched
from river_edge.runtime.costs import CostModel, cached, probe
from river_edge.runtime.drafters import resolve_drafter
from river_edge.runtime.exact import Cycle, ExactCall
from river_edge.runtime.gated import gated
from river_edge.runtime.token import Token
from river_edge.settings import SETTINGS, Guarded

DEFAULT_GATE = 1.0          # nats; used when the GGUF has no fitted gate


@dataclass
class Stats:
    mode: str = "river"
    tokens: int = 0
    seconds: float = 0.0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    fallbacks: int = 0            # gated: positions re-decoded by the backbone
    settled: int = 0              # exact: near-ties decoded again alone
    rejected: int = 0             # exact: cycles that ended on a rejected draft
    river_steps: int = 0          # gated: positions decoded by the river first (the prompt's token is not one)
    k_sum: int = 0
    spec_off: str | None = None
    # the latest generate() call: tokens, and the wall clock at its first and last token (river_edge.meter.Meter
    # times every mode from the first token to the last, as its logits processor does where it can run)
    call_tokens: int = 0
    call_drafted: int = 0         # of them, drafts that stood (each Token's `draft`)
    call_first: float = 0.0
    call_last: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def call_seconds(self) -> float:
        """The latest call's decode clock: its first token to its last."""
        return self.call_last - self.call_first if self.call_tokens > 1 else 0.0

    def cycle(self, src: str, k: int, drafted: int, accepted: int) -> None:
        """One exact-mode cycle: k asked of the cost model, `drafted` proposed by `src` and judged by the backbone
        (a settled near-tie leaves the drafts after it unjudged), `accepted` of them equal to its tokens."""
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejected += accepted < drafted
        self.k_sum += k
        by = self.extra.setdefault("by_drafter", {}).setdefault(src, {"cycles": 0, "drafted": 0, "accepted": 0})
        by["cycles"] += 1
        by["drafted"] += drafted
        by["accepted"] += accepted


class Spec:
    """The mode machinery of one RiverLlama. Its options (settings.py declares each: default, bound, help) are
    checked as they are set: `gate`, and exact mode's `kmax`, `draft_k` (or a callable drawing k per cycle: tests
    sweep k with it, as bench/levers.py fixes it) and `draft_stop`."""

    gate = Guarded(SETTINGS["gate"])
    kmax = Guarded(SETTINGS["kmax"])
    draft_k = Guarded(SETTINGS["draft_k"], lambda spec: (spec.kmax,))
    draft_stop = Guarded(SETTINGS["draft_stop"])

    def __init__(self, llm, mode: str | None, gate: float | None):
        # weakly: llm.decoding -> Spec -> llm would keep the weights and KV cache alive until a full gc pass
        self._llm = weakref.ref(llm)
        self.dec = llm.decoder   # the model as the modes see it (decoder.py)
        self._mode = F.default_mode(llm.has_river)
        self.gate = gate if gate is not None else self.stored_gate()
        self.st = Stats(mode=self._mode)
        # per draft source: decayed [accepted, rejected] counts, the running acceptance the cost model reads
        self.acceptance_counts: dict[str, list[float]] = {}
        # who drafts in exact mode: a name in DRAFTERS or "model", the Drafter itself, and the separate draft GGUF if
        # any (a DraftModel; named apart from llama-cpp-python's `draft_model`, a LlamaDraftModel, which turns exact
        # mode's speculation off). A plain GGUF drafts by prompt lookup (no model step: nothing of the river is needed)
        self.drafter_name, self.active_drafter = resolve_drafter("river" if llm.has_river else "ngram", llm)
        self.draft_gguf = None
        self.zero_run = 0   # cycles since the cost model last chose to draft (exact.py)
        # when a list, every cycle appends (top-1 probability of each draft, drafts judged, drafts agreed)
        self.draft_log: list | None = None
        self._cost_model: CostModel | None = None
        self._epoch, self._streams = 0, weakref.WeakSet()   # stream ownership (owns(), below)
        self._threads_on = False
        self.on_call_end = None   # called with call_summary() as each generate() call ends (`river serve` logs it)
        self.mode = mode if mode is not None else self._mode

    @property
    def llm(self):
        return self._llm()

    # -- mode ------------------------------------------------------------------------------------
    def stored_gate(self) -> float:
        """river.gate_entropy as the loader read it (an f32 key under validate()'s rule, or the file is refused)."""
        v = self.dec.stored_gate() if self.llm.has_river else math.nan
        return DEFAULT_GATE if math.isnan(v) else v

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, m: str) -> None:
        """The mode's river settings, without a cache check each: RiverLlama's mode setter makes the one check."""
        F.check_mode(m)
        llm = self.llm
        if m not in F.LOSSLESS_MODES and not llm.has_river:
            raise RiverError(f"mode {m!r} needs a river GGUF; {llm.model_path} has no river tensors")
        if m == "exact" and not runtime_is_patched():
            raise RiverError("exact mode needs river-edge's patched llama-cpp-python (run `make setup`); this one is stock")
        if llm.has_river:
            # backbone is the river off (the stock graph), as every benchmark's and `river eval`'s "backbone" runs it
            self.dec.enable_river(m != "backbone")
            self.dec.force_exit({"river": None, "fast": -1}.get(m, llm.n_layer - 1))
        self._mode = m
        self.st = Stats(mode=m)

    # -- stats -----------------------------------------------------------------------------------
    @property
    def drafter(self) -> str:
        dm = self.draft_gguf
        return (str(getattr(dm, "path", "")) or dm.source) if dm is not None else self.drafter_name

    @drafter.setter
    def drafter(self, d) -> None:
        name, draft = resolve_drafter(d, self.llm)
        if getattr(draft, "needs_river", False) and not self.llm.has_river:
            raise RiverError(f"drafter {name!r} needs a river GGUF; {self.llm.model_path} has no river tensors")
        dm = draft if name == "model" else None
        if dm is not self.draft_gguf:
            self.close_draft()
        self.drafter_name, self.active_drafter, self.draft_gguf = name, draft, dm
        self._owns_draft = dm is not None and dm is not d   # loaded here from a path: closed here

    def close_draft(self) -> None:
        """Free a draft model this Spec loaded (one passed in as a DraftModel is its owner's to close)."""
        if self.draft_gguf is not None and getattr(self, "_owns_draft", False):
            self.draft_gguf.close()
        self.draft_gguf, self._owns_draft = None, False

    def acceptance_of(self, src: str = "river") -> float:
        A, R = self.acceptance_counts.get(src, (0.0, 0.0))
        return (A + 1.6) / (A + R + 2.0)   # prior 0.8 worth 2 tokens

    @property
    def acceptance(self) -> float:
        return self.acceptance_of(self.active_drafter.source)

    def count(self, c: Cycle) -> None:
        """An exact-mode cycle into the stats, the draft log and its drafter's running acceptance."""
        self.st.cycle(c.source, c.k, c.judged, c.agreed)
        if self.draft_log is not None:
            self.draft_log.append((c.conf, c.judged, c.agreed))
        judged, agreed = c.judged, c.agreed
        if not judged and c.proposed is not None and c.out:   # a free proposal left undrafted, judged by the next token
            judged, agreed = 1, int(c.out[0] == c.proposed)
        if judged:   # a cycle that judged nothing says nothing of the drafts: it leaves the counts as they are
            A, R = self.acceptance_counts.get(c.source, (0.0, 0.0))
            self.acceptance_counts[c.source] = [0.9 * A + agreed, 0.9 * R + (agreed < judged)]

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model exact mode chooses k with: measured on first use (per process, model file and setup: one
        measurement serves every model loaded alike) and kept current from the cycles' own timings. One assigned
        here serves this model alone (None: the measured one again)."""
        return self._cost_model or cached(self.key())

    @cost_model.setter
    def cost_model(self, cm: CostModel | None) -> None:
        self._cost_model = cm

    def stats(self) -> dict:
        s = self.st
        d = {"mode": s.mode, "tokens": s.tokens, "seconds": s.seconds,
             "tok_s": s.tokens / s.seconds if s.seconds > 0 else 0.0,
             # the latest generate() call, from its first token to its last (every mode's decode clock)
             "call_decode_seconds": s.call_seconds,
             "call_tokens": s.call_tokens, "call_drafted": s.call_drafted}
        if s.mode == "exact":
            d.update(cycles=s.cycles, drafted=s.drafted, accepted=s.accepted,
                     acceptance_rate=s.accepted / s.drafted if s.drafted else float("nan"),
                     mean_draft_len=s.drafted / s.cycles if s.cycles else 0.0,
                     tokens_per_cycle=s.tokens / s.cycles if s.cycles else 0.0,
                     running_acceptance=self.acceptance, spec_off=s.spec_off, settled_ties=s.settled,
                     rejected_cycles=s.rejected, batch_invariant=self.llm.batch_invariant)
            cm = self.cost_model
            if cm is not None:
                d["cost_model"] = cm.as_dict()
        if s.mode == "gated":
            d.update(gate_entropy=self.gate, fallbacks=s.fallbacks, spec_off=s.spec_off,
                     fallback_rate=s.fallbacks / s.river_steps if s.river_steps else 0.0)
        d.update(s.extra)
        return d

    def reset_stats(self) -> None:
        self.st = Stats(mode=self._mode)

    # -- low level -------------------------------------------------------------------------------
    def key(self):
        """The cost model's key: what changes a step's cost or a batch row's arithmetic (its tie bound), so that
        two models of one file loaded differently never share one; and which head drafts."""
        llm = self.llm
        return (str(llm.model_path), self.dec.setup(), llm.extra_bufts, llm.rpc_servers,
                llm.has_river and llm.river_head, llm.batch_invariant, llm.exact_batch)

    def decode_threads(self, on: bool) -> None:
        self.dec.decode_threads(on)
        self._threads_on = on

    def costs(self, tok: int, pos: int) -> CostModel:
        """The cost model of this model and thread count: probed once per process (costs.probe)."""
        llm = self.llm
        return self.cost_model or probe(self.dec, tok, pos, self.kmax, self.key(), llm.exact_batch)

    # -- generate --------------------------------------------------------------------------------
    def unsupported(self, kw: dict) -> str | None:
        llm = self.llm
        checks = [
            (kw.get("temp", 0.8) > 0 and kw.get("typical_p", 1.0) < 1.0, "typical_p"),
            (kw.get("temp", 0.8) > 0 and kw.get("mirostat_mode", 0) != 0, "mirostat"),
            (kw.get("grammar") is not None, "grammar"),
            (self.dec.logits_all, "logits_all (logprobs)"),
            (llm.draft_model is not None, "draft_model"),
        ]
        bad = [name for cond, name in checks if cond]
        return ", ".join(bad) if bad else None

    def generate(self, tokens, base_generate, kw: dict):
        mode = self._mode
        if mode not in F.LOOP_MODES or not len(tokens):
            return self._timed(lambda me: base_generate(tokens, **kw))
        # exact: what the loop cannot sample exactly; gated: it never fills the logits of every position
        why = self.unsupported(kw) if mode == "exact" else ("logits_all (logprobs)" if self.dec.logits_all else None)
        self.st.spec_off = why   # this call's: a later call that does speculate clears it
        if why:
            return self._timed(lambda me: base_generate(tokens, **kw))
        if mode == "exact" and hasattr(self.active_drafter, "run"):   # a drafter with a cycle of its own (head)
            return self._timed(lambda me: self.active_drafter.run(self, list(tokens), kw, me, base_generate))
        if mode == "exact":
            return self._timed(lambda me: ExactCall(self, kw).run(list(tokens), me))
        return self._timed(lambda me: gated(self.dec, self.gate, self.st, list(tokens), kw, lambda: self.owns(me)))

    # -- stream ownership ---------------------------------------------------------------------------
    # A stream abandoned by its caller is closed whenever its owner lets go of it: by a server's cleanup or the
    # garbage collector, possibly in the middle of a later call. Each call takes the model when it starts (the
    # epoch); a stream's cleanup (cutting the cache back, the forced exit, the decode threads) runs only while
    # no later call has taken the model since, so it never touches another call's cache or settings.
    def owns(self, me: int) -> bool:
        return self._epoch == me

    def end_streams(self) -> None:
        """Close every stream a caller left open (`river serve` does so as each request takes the model)."""
        for g in list(self._streams):
            g.close()

    def _claim(self) -> int:
        self._epoch += 1
        if self._mode in F.LOOP_MODES:   # what an abandoned stream of theirs may have left: a river exit
            self.dec.force_exit(self.llm.n_layer - 1)
        if self._threads_on:                    # and the batch threads
            self.decode_threads(False)
        return self._epoch

    def _timed(self, start):
        gen = self._timed_gen(start, self.llm)
        self._streams.add(gen)
        return gen

    def _timed_gen(self, start, llm):   # llm: the stream holds its model (`RiverLlama(...).generate(...)` alone does not)
        """The call's tokens, each a Token (the modes that decode through llama-cpp-python's own loop yield ids),
        timed and counted."""
        st, mode = self.st, self._mode
        gen = start(self._claim())
        st.call_tokens = st.call_drafted = 0
        t0 = time.perf_counter()
        try:
            for tok in gen:
                if not isinstance(tok, Token):
                    tok = Token(tok, mode)
                st.call_drafted += tok.draft is not None
                now = time.perf_counter()
                st.tokens += 1
                st.seconds += now - t0
                st.call_first = now if st.call_tokens == 0 else st.call_first
                st.call_last, st.call_tokens = now, st.call_tokens + 1
                yield tok
                t0 = time.perf_counter()
        finally:
            gen.close()
            if self.on_call_end is not None:
                try:
                    self.on_call_end(self.call_summary())
                except Exception as e:   # a report of the call must not replace how it ended (tokens or an error)
                    warnings.warn(f"on_call_end failed: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)

    def call_summary(self) -> dict:
        """The latest generate() call: its mode, tokens, the drafts that stood among them (each Token's `draft`) and
        its decode speed (first token to last, as the meter times every mode)."""
        st = self.st
        return {"mode": self._mode, "tokens": st.call_tokens, "drafted": st.call_drafted,
                "tok_s": (st.call_tokens - 1) / st.call_seconds if st.call_seconds > 0 else None}

    def call_seed(self) -> int:
        """This call's sampling seed, as llama.cpp takes it: a uint32 (-1 is 0xFFFFFFFF), LLAMA_DEFAULT_SEED meaning a
        random one (drawn per call, as llama.cpp's sampler is made per call in the other modes)."""
        s = self.dec.seed
        return secrets.randbits(32) if s == llama_cpp.LLAMA_DEFAULT_SEED else s
