"""River-Spec: decoding modes of a river GGUF (exact self-speculation, entropy-gated fast path).

Modes (`RiverLlama(mode=...)`, or `llm.mode = ...`):
  backbone  forced exit L-1: the backbone alone (the river graph skipping every river node)
  fast      forced exit -1: the river alone (all layers 4-bit, the backbone's embeddings, the river's LM
            head if the GGUF has one, else the backbone's)
  river     the paper's cosine rule (forced exit: none); the default for a river GGUF
  exact     the river drafts k tokens greedily (or by sampling) into the shared KV cache, the backbone
            re-decodes the k+1 positions in one batch replacing those cells, and the longest prefix the
            backbone agrees with is kept plus the backbone's own next token. Output = backbone's.
  gated     every token on the river; when the river's output entropy >= the gate (GGUF key
            river.gate_entropy, or `gate=`), the backbone re-decodes that position and its token wins.
            The prompt is prefilled on the backbone (batched, so cheap per token, and a clean cache);
            tokens are chosen by llama.cpp's own sampler chain, so every sampler setting works.

Why a generate() override and not a llama_cpp.LlamaDraftModel: a draft model makes llama-cpp-python
set logits_all, copy every position's logits (152k floats per token on Qwen) into an n_ctx x n_vocab
array, and accept a draft only when an independently *sampled* backbone token equals it (exact in
distribution for temperature > 0, but the two draws are independent, so with sampling it wastes most
drafts). Owning the loop gives coupled sampling (the draft and the backbone's draw share their noise, below),
the acceptance statistics the cost model needs, and no per-token copies. Every other path of llama-cpp-
python (create_completion, chat, streaming, the server) goes through generate(), so they all get it.

Exactness
  greedy (temp == 0): each emitted token is argmax of backbone logits computed from a cache holding only
    backbone-written cells (drafted cells are removed before the backbone batch writes them again; the
    rejected ones are removed after). The prompt is evaluated as the stock runtime evaluates it (Llama.eval's
    n_batch chunks, the stock kernels), and so is every one-token step; a verification batch runs on ggml's
    reference kernels (RiverLlama.batch_invariant, patches/0013), which give each row the bits of decoding that
    token alone. The text, and every cell of the cache, is then the stock runtime's (llama_cpp.Llama on the same
    file) by construction; the start-up probe checks it (the cost model's batch_deviation is 0). Where rows still
    depart (batch invariance turned off; weights in a repacked layout whose batched kernel rounds otherwise; flash
    attention; a GPU or rpc-server backend), a position whose top-2 margin is within 4x the rounding the probe
    measured is decoded again alone, as backbone mode decodes it, so the output does not depend on k; the identity
    is then exact up to ties below that bound (the K/V of batched cells still differ in the last bits). Ties break
    as in llama.cpp's greedy sampler (first index).
  sampling (temp != 0): the token at position t is argmax(log p + G(seed, t)), with Gumbel noise G that is a
    pure function of the seed, the position and the token id (sampling.scores: the Gumbel-max trick, an exact
    draw from p). The river drafts on the same noise with its own q, and a draft stands exactly when the
    backbone, sampling with that noise, chooses it too (the coupling of speculative sampling by shared
    randomness). p and q are the logits put through the same transform as llama.cpp's sampler chain that
    llama-cpp-python builds (top_k -> top_p -> min_p on the untempered logits, then / temp, softmax; temp < 0:
    plain softmax). Each token is then distributed exactly as backbone sampling with those settings (up to float
    rounding at the top-p / min-p boundaries), and a seed gives one text whatever the draft lengths were (they
    come from timed costs): the same across calls and processes. It is not llama.cpp's sample stream for that
    seed (backbone mode's text for the seed differs).
  Decoded exactly by speculation: temp, top_k, top_p, min_p, seed, and the history-dependent parts of the
    chain: repeat / frequency / presence penalties over the last last_n_tokens_size generated tokens and
    logits processors (logit_bias, min_tokens), applied to every verified row with the history of its
    position (Transform). Not speculated: typical_p != 1, mirostat, grammar, logits_all (logprobs), a
    draft_model: exact mode then decodes on the backbone alone with llama.cpp's own sampler (still exact,
    no speed-up) and stats()["spec_off"] says why. A seed is taken as llama.cpp takes it (a uint32; -1 is a
    random seed), a negative last_n_tokens_size as 0 (penalties off). A stopping criterion sees the history it
    would see in backbone mode, and the context keeps no token past the last one emitted; its logits argument
    is the backbone's row for that position (llama-cpp-python passes an unfilled row without logits_all).

Drafters (river_edge/runtime/drafters.py): the river by default; prompt lookup ("ngram", "ngram-cache"), "river+ngram", or a separate
draft model (`llm.drafter = "draft.gguf"`), all through this one loop, so exactness holds for each alike.

Choosing k: tokens per cycle E(k) = (1 - a^(k+1)) / (1 - a) for a per-token acceptance a (a decayed running
estimate per drafter), cost(k) = k * draft_step + verify(k + 1); k = argmax E/cost over 0..kmax. The costs are
measured on this machine on first use (per process, per model file and thread count) and kept current
from the timings of the cycles themselves; an n-gram draft costs no model step. A cycle drafting with a model
stops early after a draft whose top-1 probability is below DRAFT_STOP (that draft is still verified).
"""
from __future__ import annotations

import math
import secrets
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import llama_cpp
import numpy as np

from river_edge import format as F
from river_edge.runtime.capi import runtime_is_patched
from river_edge.runtime.costs import CostModel, cached, probe
from river_edge.runtime.drafters import LOOKUP, Drafter, RiverDraft, resolve
from river_edge.runtime.gated import gated
from river_edge.runtime.headdraft import TrimmedHead, head_exact, head_rows
from river_edge.runtime.headrank import load_or_build
from river_edge.format import MODES, RiverError
from river_edge.runtime.sampling import Transform, agree, margin, processed_probs, scores, top1_prob

DEFAULT_GATE = 1.0          # nats; used when the GGUF has no fitted gate
KMAX = 8
PROBE_IDLE = 128          # tokens between probes where no acceptance could make drafting pay
# a cycle stops drafting after a model draft whose top-1 probability is below this: on the 1.5B the backbone took
# 64% of drafts below 0.5 and all 607 at 0.7 or more (bench/levers.py; docs/design.md, section 4)
DRAFT_STOP = 0.5


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
    # the latest generate() call: tokens, and the wall clock at its first and last token (river_edge.chat.Meter
    # times every mode from the first token to the last, as its logits processor does where it can run)
    call_tokens: int = 0
    call_first: float = 0.0
    call_last: float = 0.0
    extra: dict = field(default_factory=dict)

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
    """The mode machinery of one RiverLlama."""

    def __init__(self, llm, mode: str | None, gate: float | None, kmax: int = KMAX):
        # weakly: llm.modes -> Spec -> llm would keep the weights and KV cache alive until a full gc pass
        self._llm = weakref.ref(llm)
        self.dec = llm.decoder   # the model as the modes see it (decoder.py)
        self.kmax = int(kmax)
        self._mode = F.default_mode(llm.has_river)
        self.gate = F.check_gate(gate) if gate is not None else self.stored_gate()
        self.st = Stats(mode=self._mode)
        # per draft source: decayed [accepted, rejected] counts, the running acceptance the cost model reads
        self.acceptance_counts: dict[str, list[float]] = {}
        # a plain GGUF drafts by prompt lookup (no model step: nothing of the river is needed)
        self.drafter_name, self.draft_model = ("river" if llm.has_river else "ngram"), None
        self._zero_run = 0
        # draft exactly this many per cycle instead of the cost model's k (or a callable drawing k per cycle:
        # tests sweep k with it, as bench/levers.py fixes it)
        self.draft_k: int | Callable[[], int] | None = None
        # when a list, every cycle appends (top-1 probability of each draft, drafts judged, drafts agreed)
        self.draft_log: list | None = None
        self.draft_stop: float | None = DRAFT_STOP   # None: draft the cost model's k whatever the confidence
        self._cost_model: CostModel | None = None
        self._epoch, self._streams = 0, weakref.WeakSet()   # stream ownership (owns(), below)
        self._threads_on = False
        self._head_rows = None   # the head drafter's trimmed head (headdraft.py), made on first use
        self.trimmed_rows: int | None = None   # its row count (None: headdraft.head_rows of the vocabulary)
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
        if m not in MODES:
            raise RiverError(f"unknown mode {m!r}: use one of {', '.join(MODES)}")
        llm = self.llm
        if m not in F.LOSSLESS_MODES and not llm.has_river:
            raise RiverError(f"mode {m!r} needs a river GGUF; {llm.model_path} has no river tensors")
        if m == "exact" and not runtime_is_patched():
            raise RiverError("exact mode needs river-edge's patched llama-cpp-python (run `make setup`); this one is stock")
        if llm.has_river:
            self.dec.enable_river()
            llm.force_exit({"river": None, "fast": -1}.get(m, llm.n_layer - 1))
        self._mode = m
        self.st = Stats(mode=m)

    # -- stats -----------------------------------------------------------------------------------
    @property
    def drafter(self) -> str:
        dm = self.draft_model
        return (str(getattr(dm, "path", "")) or dm.source) if dm is not None else self.drafter_name

    @drafter.setter
    def drafter(self, d) -> None:
        name, dm = resolve(d, self.llm)
        if name in ("river", "river+ngram") and not self.llm.has_river:
            raise RiverError(f"drafter {name!r} needs a river GGUF; {self.llm.model_path} has no river tensors")
        if dm is not self.draft_model:
            self.close_draft()
        self.drafter_name, self.draft_model = name, dm
        self._owns_draft = dm is not None and dm is not d   # loaded here from a path: closed here

    def close_draft(self) -> None:
        """Free a draft model this Spec loaded (one passed in as a DraftModel is its owner's to close)."""
        if self.draft_model is not None and getattr(self, "_owns_draft", False):
            self.draft_model.close()
        self.draft_model, self._owns_draft = None, False

    def _model_drafter(self) -> Drafter | None:
        """Who drafts when prompt lookup does not: a separate draft model, the river, or nobody (lookup alone)."""
        if self.draft_model is not None:
            return self.draft_model
        return RiverDraft(self.dec) if self.drafter_name in ("river", "river+ngram") else None

    def acceptance_of(self, src: str = "river") -> float:
        A, R = self.acceptance_counts.get(src, (0.0, 0.0))
        return (A + 1.6) / (A + R + 2.0)   # prior 0.8 worth 2 tokens

    @property
    def acceptance(self) -> float:
        d = self._model_drafter()
        return self.acceptance_of(d.source if d is not None else self.drafter_name)

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
             "call_decode_seconds": s.call_last - s.call_first if s.call_tokens > 1 else 0.0}
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

    def _decode_threads(self, on: bool) -> None:
        self.dec.decode_threads(on)
        self._threads_on = on

    def costs(self, tok: int, pos: int) -> CostModel:
        """The cost model of this model and thread count: probed once per process (costs.probe)."""
        return self.cost_model or probe(self, tok, pos)

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
        if mode == "exact" and self.drafter_name == "head":
            return self._timed(lambda me: self._head(list(tokens), kw, me, base_generate))
        if mode == "exact":
            return self._timed(lambda me: self._exact(list(tokens), kw, me))
        return self._timed(lambda me: gated(self, list(tokens), kw, me))

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
            self._decode_threads(False)
        return self._epoch

    def _timed(self, start):
        gen = self._timed_gen(start)
        self._streams.add(gen)
        return gen

    def _timed_gen(self, start):
        st = self.st
        gen = start(self._claim())
        st.call_tokens = 0
        t0 = time.perf_counter()
        try:
            for tok in gen:
                now = time.perf_counter()
                st.tokens += 1
                st.seconds += now - t0
                st.call_first = now if st.call_tokens == 0 else st.call_first
                st.call_last, st.call_tokens = now, st.call_tokens + 1
                yield tok
                t0 = time.perf_counter()
        finally:
            gen.close()

    def prompt(self, tokens: list[int], reset: bool) -> np.ndarray:
        """Evaluate the prompt on the backbone exactly as backbone mode (Llama.generate) does: the cached
        prefix reused up to the last prompt token, the rest by Llama.eval in n_batch chunks. Returns the
        logits of the last prompt position (a copy); llm.n_tokens is then the first free position."""
        llm, dec = self.llm, self.dec
        # the context's last logits will be whichever row this loop decoded last (a rejected draft's, say)
        dec.logits_stale()
        keep = 0
        if reset and llm.n_tokens > 0:
            for a, b in zip(llm.input_ids[:llm.n_tokens], tokens[:-1]):
                if a != b:
                    break
                keep += 1
        elif not reset:
            keep = llm.n_tokens
            tokens = list(llm.input_ids[:llm.n_tokens]) + tokens
        if len(tokens) > llm.n_ctx():
            raise RiverError(f"prompt of {len(tokens)} tokens does not fit the context of {llm.n_ctx()}")
        llm.n_tokens = keep
        dec.remove(keep)
        dec.force_exit(llm.n_layer - 1)
        # Llama.eval's chunks (n_batch, logits of each chunk's last token), but on sequence 0 alone: eval
        # clears every sequence's cells past n_tokens
        rest = tokens[keep:]
        for i in range(0, len(rest), llm.n_batch):
            chunk = rest[i:i + llm.n_batch]
            row = dec.decode(chunk, llm.n_tokens)[0]
            llm.input_ids[llm.n_tokens:llm.n_tokens + len(chunk)] = chunk
            llm.n_tokens += len(chunk)
        return np.array(row)

    def _cut(self, n: int) -> None:
        self.llm.n_tokens = n
        self.dec.remove(n)

    def _call_seed(self) -> int:
        """This call's sampling seed, as llama.cpp takes it: a uint32 (-1 is 0xFFFFFFFF), LLAMA_DEFAULT_SEED meaning a
        random one (drawn per call, as llama.cpp's sampler is made per call in the other modes)."""
        s = self.dec.seed
        return secrets.randbits(32) if s == llama_cpp.LLAMA_DEFAULT_SEED else s

    def _head(self, tokens: list[int], kw: dict, me: int, base_generate):
        """Head drafting (headdraft.py): greedy text without logits processors or penalties; else the backbone alone,
        and stats()["spec_off"] says why."""
        tf = Transform(kw, self.llm.last_n_tokens_size)
        why = ("sampling" if float(kw.get("temp", 0.8)) != 0.0 else
               "logits processors or penalties" if tf else None)
        self.st.spec_off = why and f"{why} (the head drafter drafts plain greedy text)"
        if why:
            yield from base_generate(tokens, **kw)
            return
        n_rows = self.trimmed_rows or head_rows(self.dec.n_vocab)
        if self._head_rows is None or self._head_rows.n_rows != n_rows:
            self._head_rows = TrimmedHead(self.dec, load_or_build(self.llm), n_rows)
        yield from head_exact(self, tokens, kw, me, self._head_rows)

    def _exact(self, tokens: list[int], kw: dict, me: int):
        llm, st = self.llm, self.st
        L = llm.n_layer
        temp = float(kw.get("temp", 0.8))
        greedy = temp == 0.0
        sp = dict(temp=temp, top_k=int(kw.get("top_k", 40)), top_p=float(kw.get("top_p", 0.95)),
                  min_p=float(kw.get("min_p", 0.05)))
        stop = kw.get("stopping_criteria")
        seed = None if greedy else self._call_seed()
        unit = temp if temp > 0 else 1.0   # a logit's rounding, in sampling scores (logits / temp + noise)

        def choose(rows: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
            """The token for positions pos, pos+1, ... from rows of logits, and the scores it is the argmax of: the
            logits (greedy), or the log-probabilities of llama.cpp's chain plus that position's noise (sampling)."""
            if greedy:
                return rows, rows.argmax(1)
            s = np.stack([scores(processed_probs(r, **sp), seed, pos + i) for i, r in enumerate(rows)])
            return s, s.argmax(1)
        dec = self.dec
        tf = Transform(kw, llm.last_n_tokens_size)
        gen: list[int] = []          # tokens generated in this call: the penalties' window
        row = self.prompt(tokens, kw.get("reset", True))
        n, n_ctx = llm.n_tokens, llm.n_ctx()
        # the first token from the prompt's own logits, as backbone mode takes it
        row = tf(row, llm.input_ids[:n], gen) if tf else row
        pending = int(choose(row[None], n)[1][0])
        if stop is not None and stop(llm.input_ids[:n], row):
            return
        gen.append(pending)
        yield pending
        if n >= n_ctx:
            return
        llm.input_ids[n] = pending
        self._decode_threads(True)
        try:
            cm = self.costs(pending, n)
            drafter = self._model_drafter()
            lookup = LOOKUP.get(self.drafter_name)
            ngram = lookup(llm.input_ids[:n + 1]) if lookup is not None else None
            while n < n_ctx:
                # prompt lookup's proposals where it has some (or where it drafts alone), else the model's drafts
                cands = ngram.propose(self.kmax) if ngram is not None else None
                free = cands is not None and (bool(cands) or drafter is None)
                src = (self.drafter_name if drafter is None else "ngram") if free else drafter.source
                k = cm.best_k(self.acceptance_of(src), self.kmax, src)
                if k == 0 and not free:
                    self._zero_run += 1
                    # probe now and then: the acceptance may have changed; rarely where even drafts that are
                    # always accepted would not pay at the measured costs (a probe there is pure loss)
                    if self._zero_run >= PROBE_IDLE or (self._zero_run >= 16 and cm.best_k(1.0, self.kmax, src)):
                        k, self._zero_run = 1, 0
                else:
                    self._zero_run = 0
                if self.draft_k is not None:   # a fixed k, but never a batch size whose rows depart where others do not
                    k = cm.exact_k(self.draft_k() if callable(self.draft_k) else self.draft_k)
                if free:
                    k = min(k, len(cands))
                # the verification batch (k + 1 tokens) must fit the context and llama.cpp's n_batch
                k = max(0, min(k, n_ctx - n - 1, llm.n_batch - 1))
                drafts, conf = [], []
                if k and free:           # free drafts: proposals the backbone's choice keeps or not
                    for d in cands[:k]:
                        drafts.append(int(d))
                        if dec.is_eog(d):
                            break
                elif k:
                    # a draft model catches up on the tokens accepted since it last drafted (one batch, not a
                    # per-token cost: charged to a draft token it would keep one that fell behind at k = 0); the
                    # river writes cells n..n+k-1 of the shared cache
                    drafter.begin(list(llm.input_ids[:n]))
                    x = pending
                    # k as chosen, unless a draft the model is unsure of comes first (not with a fixed k)
                    unsure = self.draft_stop if self.draft_stop is not None and self.draft_k is None else 0.0
                    t0 = time.perf_counter()
                    for i in range(k):
                        row = drafter.step(x, n + i)
                        if tf:   # the draft sees the history it would have: acceptance stays high
                            row = tf(row, [*llm.input_ids[:n + 1], *drafts], gen + drafts)
                        c = top1_prob(row) if unsure or self.draft_log is not None else 1.0
                        if self.draft_log is not None:
                            conf.append(c)
                        d = int(choose(row[None], n + 1 + i)[1][0])   # on the noise the backbone will use there
                        drafts.append(d)
                        x = d
                        if dec.is_eog(d) or c < unsure:
                            break
                    cm.observe(0, (time.perf_counter() - t0) / len(drafts), src)
                    drafter.end()
                # -- verify on the backbone: positions n..n+len(drafts), replacing the river's cells
                dec.remove(n)
                t0 = time.perf_counter()
                batch = [pending] + drafts
                rows = dec.verify(batch, n, llm.verify_invariant)
                cm.observe(len(batch), time.perf_counter() - t0)
                if tf:   # row i: the history through batch[i], as the sampler would have it there
                    base = list(llm.input_ids[:n + 1])

                    def at(i, row):
                        return tf(row, base + drafts[:i], gen + drafts[:i])
                    rows = np.stack([at(i, rows[i]) for i in range(len(batch))])
                # row i chooses the token at position n+1+i; a draft stands while it is that token
                sc, g = choose(rows, n + 1)
                j = agree(drafts, g)
                out = drafts[:j] + [int(g[j])]
                agreed, judged = j, len(drafts)
                bound = cm.ties[len(batch)] if len(batch) < len(cm.ties) else cm.tie
                tie = next((i for i in range(j + 1) if margin(sc[i], g[i]) * unit <= bound), None) if bound else None
                if tie is not None:
                    # a near-tie: the batch's rounding may decide it, so decode that position alone,
                    # as backbone mode does, and let that row decide (the rows before it stand)
                    st.settled += 1
                    rows = np.array(rows[:tie + 1])
                    dec.remove(n + tie)
                    rows[tie] = dec.decode([batch[tie]], n + tie)[0]
                    if tf:
                        rows[tie] = at(tie, rows[tie])
                    j, out = tie, drafts[:tie] + [int(choose(rows[tie:tie + 1], n + 1 + tie)[1][0])]
                    # acceptance counts the drafts judged: those through the tie, the one there accepted if
                    # the lone row agrees with it (it is emitted as the backbone's own token); the rest go unjudged
                    judged = min(tie + 1, len(drafts))
                    agreed = tie + (tie < len(drafts) and out[-1] == drafts[tie])
                # -- keep the backbone cells of pending + accepted drafts
                keep = n + 1 + j
                llm.input_ids[n:keep] = batch[: j + 1]
                llm.n_tokens = keep
                dec.remove(keep)
                st.cycle(src, k, judged, agreed)
                if self.draft_log is not None:
                    self.draft_log.append((conf, judged, agreed))
                A, R = self.acceptance_counts.get(src, (0.0, 0.0))
                self.acceptance_counts[src] = [0.9 * A + agreed, 0.9 * R + (agreed < judged)]
                if stop is not None:
                    rows = np.array(rows[: j + 1])
                for i, tok in enumerate(out):
                    # stopped at tok (a stopping criterion, or the caller closing us): the cache keeps the tokens
                    # before it, as backbone decoding leaves it, not accepted drafts nobody saw (the caller's
                    # last stopping check reads them)
                    if stop is not None and stop(llm.input_ids[: n + i + 1], rows[i]):
                        self._cut(n + 1 + i)
                        return
                    gen.append(tok)
                    try:
                        yield tok
                    except GeneratorExit:
                        if self.owns(me):
                            self._cut(n + 1 + i)
                        raise
                pending, n = out[-1], keep
                if ngram is not None:
                    ngram.extend(out)
                if n < n_ctx:
                    llm.input_ids[n] = pending
        finally:
            if self.owns(me):
                dec.force_exit(L - 1)
                self._decode_threads(False)
