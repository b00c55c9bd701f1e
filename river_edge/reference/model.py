"""The River-LLM reference: a GGUF's backbone and river layers over one shared KV cache, in PyTorch.

It is the specification the patched llama.cpp is tested against (gguf_tools/FORMAT.md, "The exit rule"),
and the engine calibration runs on. With emulate=True activations are rounded as ggml rounds them
(ggml_numerics.py) and the cache is f16, as in llama.cpp.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F   # as in its siblings (llama.py, gemma3.py): torch's, not river_edge.format
from gguf import GGMLQuantizationType

from river_edge.format import LAYER_WEIGHTS, RIVER_HEAD, RiverError, backbone_tensor, head_source, river_tensor
from . import gemma3, llama, mistral3, qwen2, qwen3
from .ggml_numerics import round_f16
from .weights import Args, read_gguf

BLOCKS = {"llama": llama.Block, "qwen2": qwen2.Block, "qwen3": qwen3.Block, "gemma3": gemma3.Block,
          "mistral3": mistral3.Block}


@dataclass
class Policy:
    """How a step chooses its exit layer e (-1 all-river .. L-1 backbone)."""
    thresholds: Sequence[float] | None = None  # None: the GGUF's river.thresholds
    min_exit_layer: int | None = None          # None: the GGUF's river.min_exit_layer
    forced: int | Sequence[int] | None = None  # a fixed exit layer (one per sequence with per_sequence)
    river: bool = True                         # False: the plain backbone (the GGUF may lack a river)
    head: bool = True                          # all-river sequences use the river LM head, if the GGUF has one

    @staticmethod
    def backbone() -> "Policy":
        return Policy(river=False)

    @staticmethod
    def all_river() -> "Policy":
        return Policy(forced=-1)


class Cache:
    """One sequence's KV cache: [n_layer, max_len, n_head_kv, head_dim] for K and V."""

    def __init__(self, args: Args, max_len: int):
        shape = (args.n_layer, max_len, args.n_head_kv, args.head_dim)
        self.k, self.v, self.n = torch.zeros(shape), torch.zeros(shape), 0

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)


@dataclass
class Step:
    logits: list[torch.Tensor]  # per sequence, [tokens, vocab]
    exit_layer: int | list[int]  # a list with per_sequence=True
    sims: torch.Tensor          # [tokens of the batch, n_layer]: cos(h_l, h_l+1), NaN where not run
    hidden: torch.Tensor | None = None  # [n_layer+1, tokens, n_embd]: h_0..h_L, with keep_hidden


class RiverModel:
    def __init__(self, path: str | Path, emulate: bool = True, unrounded: Sequence[str] = ()):
        """`unrounded`: weights whose ggml kernel multiplies f32 activations as they are (ggml's AMX F16
        kernels do; the plain CPU path rounds them to the weight's vec_dot_type first)."""
        self.path = Path(path)
        self.args, t = read_gguf(path)
        t = {n: replace(w, type=GGMLQuantizationType.F32) if n in unrounded else w for n, w in t.items()}
        a, self.emulate = self.args, emulate
        Block = BLOCKS[a.arch]
        backbone = lambda i: {n: t[backbone_tensor(i, n)] for n in LAYER_WEIGHTS}
        self.backbone = [Block(a, t, i, backbone(i), emulate) for i in range(a.n_layer)]
        self.has_river = river_tensor(0, "attn_q") in t
        self.river = [Block(a, t, i, {n: t[river_tensor(i, n)] for n in LAYER_WEIGHTS}, emulate)
                      for i in range(a.n_layer)] if self.has_river else None
        self.tok_embd = t["token_embd.weight"].w
        self.out_norm = t["output_norm.weight"].w
        self.head = llama.Linear(t[head_source(t)], None, emulate)
        self.river_head = llama.Linear(t[RIVER_HEAD], None, emulate) if RIVER_HEAD in t else None

    def new_cache(self, max_len: int = 512) -> Cache:
        return Cache(self.args, max_len)

    # -- the rule --------------------------------------------------------------------------------
    def _resolve(self, p: Policy):
        L = self.args.n_layer
        if not p.river:
            return [float("inf")] * L, L - 1, L - 1
        tau = list(p.thresholds if p.thresholds is not None else self.args.thresholds)
        m = self.args.min_exit_layer if p.min_exit_layer is None else p.min_exit_layer
        if len(tau) != L or any(x != x for x in tau):
            raise RiverError(f"thresholds must be {L} numbers, none NaN")
        if not 0 <= m < L:
            raise RiverError(f"min exit layer {m} out of range 0..{L - 1}")
        forced = [] if p.forced is None else [p.forced] if isinstance(p.forced, int) else list(p.forced)
        if any(not -1 <= f < L for f in forced):
            raise RiverError(f"forced exit layer {p.forced} out of range -1..{L - 1}")
        if self.river is None and (any(f < L - 1 for f in forced) or any(x != float("inf") for x in tau)):
            raise RiverError("this GGUF has no river tensors: build one with `river build`")
        return tau, m, p.forced

    def _attend(self, il: int, seqs: list[tuple[Cache, int, int]]):
        """attend(q, k, v) for layer il over a batch of sequences: (cache, first row, n tokens) each."""
        blk = self.backbone[il]   # the river layer attends as its backbone layer does

        def attend(q, k, v):
            a, out = self.args, []
            if self.emulate:  # f16 cache; ggml's KQ and KQV matmuls take f16 activations
                k, v, q = round_f16(k), round_f16(v), round_f16(q)
            rep = a.n_head // a.n_head_kv
            for cache, r0, n in seqs:
                p0 = cache.n
                cache.k[il, p0:p0 + n], cache.v[il, p0:p0 + n] = k[r0:r0 + n], v[r0:r0 + n]
                K, V = cache.k[il, :p0 + n], cache.v[il, :p0 + n]          # [S, Hkv, D]
                qg = q[r0:r0 + n].view(n, a.n_head_kv, rep, a.head_dim)  # head h reads kv head h // rep
                s = torch.einsum("tgrd,sgd->grts", qg, K) * blk.kq_scale
                back = (p0 + torch.arange(n))[:, None] - torch.arange(p0 + n)[None, :]   # query pos - key pos
                masked = (back < 0) | (back >= blk.window) if blk.window else back < 0
                pr = torch.softmax(s.masked_fill(masked, float("-inf")), -1)
                if self.emulate:
                    pr = round_f16(pr)
                out.append(torch.einsum("grts,sgd->tgrd", pr, V).reshape(n, a.n_head, a.head_dim))
            return torch.cat(out)
        return attend

    @torch.no_grad()
    def step(self, batch: Sequence[tuple[Sequence[int], Cache]], policy: Policy = Policy(),
             per_sequence: bool = False, keep_hidden: bool = False) -> Step:
        """One ubatch: each sequence's tokens are appended to its cache and the min over all tokens
        decides the exit, as in the runtime. per_sequence=True lets every sequence exit on its own
        (the min over its own tokens): the same as stepping them one by one, only faster."""
        tau, m, forced = self._resolve(policy)
        L = self.args.n_layer
        seqs, rows, pos = [], 0, []
        for toks, cache in batch:
            n = len(toks)
            if cache.n + n > cache.k.shape[1]:
                raise RiverError(f"sequence longer than the cache ({cache.k.shape[1]} tokens)")
            seqs.append((cache, rows, n))
            pos.append(torch.arange(cache.n, cache.n + n))
            rows += n
        tokens = torch.tensor([t for toks, _ in batch for t in toks], dtype=torch.long)
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.args.n_vocab):
            raise RiverError(f"token id out of range 0..{self.args.n_vocab - 1}")
        pos, h = torch.cat(pos), self.backbone[0].embed(self.args, self.tok_embd[tokens])
        groups = [[i] for i in range(len(seqs))] if per_sequence else [list(range(len(seqs)))]
        if forced is None:
            exits, decided = [L - 1] * len(groups), [False] * len(groups)
        else:
            exits = list(forced) if not isinstance(forced, int) else [forced] * len(groups)
            if len(exits) != len(groups):
                raise RiverError(f"{len(exits)} forced exit layers for {len(groups)} sequences")
            decided = [True] * len(groups)
        sims = torch.full((rows, L), float("nan"))
        hidden = [h.clone()] if keep_hidden else None
        for il in range(L):
            for on_river in (False, True):
                g = [j for j in range(len(groups)) if (il > exits[j]) == on_river]
                sel = [seqs[i] for j in g for i in groups[j]]
                if not sel:
                    continue
                idx = torch.cat([torch.arange(r0, r0 + n) for _, r0, n in sel])
                local, r = [], 0
                for cache, _, n in sel:
                    local.append((cache, r, n))
                    r += n
                block = (self.river if on_river else self.backbone)[il]
                out = block(h[idx], pos[idx], self._attend(il, local))
                if not on_river:
                    sims[idx, il] = F.cosine_similarity(h[idx], out, dim=-1)
                h[idx] = out
            if keep_hidden:
                hidden.append(h.clone())
            for j, grp in enumerate(groups):
                if decided[j] or il > exits[j] or not m <= il < L - 1:
                    continue
                rs = torch.cat([torch.arange(seqs[i][1], seqs[i][1] + seqs[i][2]) for i in grp])
                if sims[rs, il].min().item() > tau[il]:
                    exits[j], decided[j] = il, True
        hn = llama.rms_norm(h, self.out_norm, self.args.eps)
        logits = self.head(hn)
        if self.river_head is not None and policy.river and policy.head and -1 in exits:
            rr = [r for j, grp in enumerate(groups) if exits[j] == -1 for i in grp for r in range(seqs[i][1], seqs[i][1] + seqs[i][2])]
            logits[rr] = self.river_head(hn[rr])
        if self.args.softcap:
            logits = torch.tanh(logits / self.args.softcap) * self.args.softcap
        for cache, _, n in seqs:
            cache.n += n
        exit_of = [exits[j] for j, grp in enumerate(groups) for _ in grp]
        return Step([logits[r0:r0 + n] for _, r0, n in seqs], exit_of if per_sequence else exits[0], sims,
                    torch.stack(hidden) if keep_hidden else None)

    def generate(self, prompt: Sequence[int], n_new: int, policy: Policy = Policy(),
                 prefill_policy: Policy | None = None) -> tuple[list[int], list[int], list[torch.Tensor]]:
        """Greedy decoding: (new tokens, exit layer of every step (prefill first), last-position logits)."""
        cache = self.new_cache(len(prompt) + n_new)
        st = self.step([(prompt, cache)], prefill_policy or policy)
        exits, logits, out = [st.exit_layer], [st.logits[0][-1]], []
        for _ in range(n_new):
            out.append(int(logits[-1].argmax()))
            if len(out) == n_new:
                break
            st = self.step([([out[-1]], cache)], policy)
            exits.append(st.exit_layer)
            logits.append(st.logits[0][-1])
        return out, exits, logits
