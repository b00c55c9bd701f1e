"""The online checks' teacher-forced decodes, every decode token of a prompt in one pass instead of one step each.

The online checks feed the backbone's own greedy tokens back (teacher forcing), so every token is known before the
check starts; only what each token does (its exit layer; the gated mode's fallback) depends on earlier tokens, and
then only through the K/V they leave at each layer. Layer by layer over all tokens at once, with causal attention,
gives the step-by-step decode's result (RiverModel.step, one token per step):
  - the rule decides a token's exit from its own backbone layers below, so at layer il every token already knows
    whether it runs the backbone's or the river's layer il, and the K/V it writes there;
  - a forced exit (random selection, all-river) is known before the pass;
  - the gated mode decides a fallback only after the token's whole river pass, which depends on the fallbacks of
    earlier tokens: a fixed point, found by passes that start from "no fallback" and repeat until no decision
    changes. A decision depends only on earlier ones, so after k passes at least the first k are final and the
    fixed point is the step-by-step answer.
The results equal the step-by-step decode's up to float rounding (tests/test_calibrate.py compares them); the cost is
a few passes of n tokens where the step-by-step decode ran n steps of one token (each reading every weight again).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..reference import Cache, Policy, RiverModel
from ..reference.ggml_numerics import round_f16
from ..reference.llama import rms_norm


WINDOW = 64   # the gated mode's tokens per fixed point (SmolLM2, 256 tokens: 16 cost 1.7x, 32 1.2x, 256 1.7x)


def _layer(model: RiverModel, il: int, streams: list, pick: torch.Tensor, cache: Cache, p0: int,
           pos: torch.Tensor) -> list[torch.Tensor]:
    """Layer il over the n decode tokens after a cache holding p0 positions. streams: (block, h [rows, d], rows)
    each; every stream's token attends to the cache's K/V at earlier positions (the prompt's, then at each decode
    position the K/V of stream pick[row]) and to its own K/V at its own position. Returns each stream's output.
    Each stream's q, k, v are projected once (Block.project), its K/V written where pick takes them, then each
    attends (Block.finish)."""
    a = model.args
    n, rep = len(pos), a.n_head // a.n_head_kv
    qkv = [blk.project(h, pos[rows]) for blk, h, rows in streams]
    if model.emulate:
        qkv = [tuple(round_f16(x) for x in t) for t in qkv]
    K, V = cache.k[il], cache.v[il]
    for s, ((_, _, rows), (_, k, v)) in enumerate(zip(streams, qkv)):
        mine = pick[rows] == s
        K[p0 + rows[mine]], V[p0 + rows[mine]] = k[mine], v[mine]
    S = p0 + n
    K, V = K[:S], V[:S]
    out = []
    for (blk, h, rows), (q, k, v) in zip(streams, qkv):
        back = pos[rows][:, None] - torch.arange(S)[None, :]          # query position - key position
        masked = (back <= 0) | (back >= blk.window) if blk.window else back <= 0   # earlier keys; its own apart
        t = len(rows)
        qg = q.view(t, a.n_head_kv, rep, a.head_dim)
        sc = torch.einsum("tgrd,sgd->grts", qg, K) * blk.kq_scale
        sc = sc.masked_fill(masked, float("-inf"))
        own = torch.einsum("tgrd,tgd->grt", qg, k)[..., None] * blk.kq_scale
        pr = torch.softmax(torch.cat([sc, own], -1), -1)
        if model.emulate:
            pr = round_f16(pr)
        o = torch.einsum("grts,sgd->tgrd", pr[..., :S], V) + pr[..., S].permute(2, 0, 1)[..., None] * v[:, :, None]
        out.append(blk.finish(h, o.reshape(t, a.n_head, a.head_dim)))
    return out


def _logits(model: RiverModel, h: torch.Tensor, river_rows: torch.Tensor | None) -> torch.Tensor:
    """The LM head over the final states; rows in river_rows (all-river tokens) take the river's head if any."""
    hn = rms_norm(h, model.out_norm, model.args.eps)
    lg = model.head(hn)
    if model.river_head is not None and river_rows is not None and len(river_rows):
        lg[river_rows] = model.river_head(hn[river_rows])
    if model.args.softcap:
        lg = torch.tanh(lg / model.args.softcap) * model.args.softcap
    return lg


@torch.no_grad()
def decode_pass(model: RiverModel, cache: Cache, tokens: Sequence[int], policies: Sequence[Policy]):
    """The tokens decoded one per step after the cache's positions, step i under policies[i] (one sequence:
    a forced exit is an int), all in one pass. Returns (logits [n, vocab], exit layer per token)."""
    L, n, p0 = model.args.n_layer, len(tokens), cache.n
    if p0 + n > cache.k.shape[1]:
        raise ValueError(f"{n} tokens after {p0} do not fit a cache of {cache.k.shape[1]}")
    forced = [p.forced for p in policies]
    if all(f is not None for f in forced):
        exits, decided = torch.tensor([f if isinstance(f, int) else f[0] for f in forced]), torch.ones(n, dtype=torch.bool)
        tau = m = None
    elif all(f is None for f in forced):
        tau, m, _ = model._resolve(policies[0])
        if any(model._resolve(p)[:2] != (tau, m) for p in policies[1:]):
            raise ValueError("one pass takes one rule for every step")
        exits, decided = torch.full((n,), L - 1), torch.zeros(n, dtype=torch.bool)
    else:
        raise ValueError("one pass takes forced exits at every step or at none")
    pos = p0 + torch.arange(n)
    h = model.backbone[0].embed(model.args, model.tok_embd[torch.tensor(tokens, dtype=torch.long)])
    for il in range(L):
        on_river = il > exits
        streams = [(blocks[il], h[rows], rows) for blocks, rows in
                   ((model.backbone, torch.nonzero(~on_river)[:, 0]), (model.river, torch.nonzero(on_river)[:, 0]))
                   if len(rows)]
        pick = torch.zeros(n, dtype=torch.long) if len(streams) == 1 else on_river.long()
        outs = _layer(model, il, streams, pick, cache, p0, pos)
        for (blk, hin, rows), o in zip(streams, outs):
            if blk is model.backbone[il] and tau is not None and m <= il < L - 1:
                sims = torch.nn.functional.cosine_similarity(hin, o, dim=-1)
                now = rows[(~decided[rows]) & (sims > tau[il])]
                exits[now], decided[now] = il, True
            h[rows] = o
    cache.n = p0 + n
    return _logits(model, h, torch.nonzero(exits == -1)[:, 0] if policies[0].river and policies[0].head else None), \
        exits.tolist()


@torch.no_grad()
def gated_pass(model: RiverModel, cache: Cache, tokens: Sequence[int], gate: float, entropy,
               window: int = WINDOW, guess: torch.Tensor | None = None):
    """The gated mode over the tokens, one per step after the cache's positions: each token decoded on the river
    (reading the K/V that earlier tokens left), and where the river's entropy >= gate decoded again on the backbone,
    whose K/V then replace the river's. Returns (logits [n, vocab], fallback per token, passes run, the river's
    entropy per token).

    The tokens go `window` at a time; each pass over a window starts at the first token whose decision the last one
    changed (those before it are final, their K/V in the cache) and runs the backbone only for the tokens it takes
    to fall back. A window's first pass guesses its fallbacks: `guess` (a bool per token, e.g. an earlier check's
    entropies against this gate), else none. The answer does not depend on the guess (every pass settles at least
    its first token), the passes do: a window settles in a pass or two more than the guesses it got wrong in a chain;
    guessing "none" gets about 40% wrong at SmolLM2's gate, and takes a pass more per window."""
    L, n, p0 = model.args.n_layer, len(tokens), cache.n
    pos = p0 + torch.arange(n)
    x = model.backbone[0].embed(model.args, model.tok_embd[torch.tensor(tokens, dtype=torch.long)])
    fall = guess.clone() if guess is not None else torch.zeros(n, dtype=torch.bool)
    passes, ent = 0, torch.empty(n)
    river, hback = None, torch.empty_like(x)
    for start in range(0, n, window):
        end = min(start + window, n)
        while True:
            passes += 1
            rows = torch.arange(start, end)
            brows = rows[fall[rows]]
            hr, hb = x[rows].clone(), x[brows].clone()
            for il in range(L):
                streams = [(model.river[il], hr, rows)] + ([(model.backbone[il], hb, brows)] if len(brows) else [])
                out = _layer(model, il, streams, fall.long(), cache, p0, pos)
                hr, hb = out[0], out[-1] if len(brows) else hb
            lr = _logits(model, hr, torch.arange(len(rows)))
            if river is None:
                river = torch.empty(n, lr.shape[1])
            river[rows], hback[brows] = lr, hb   # the backbone's logits once, for the final fallbacks
            ent[rows] = entropy(lr)
            again = ent[rows] >= gate
            changed = torch.nonzero(again != fall[rows])[:, 0]
            if not len(changed):
                break
            # the first changed decision is final (every one before it is); the rest are the next pass's guess
            fall[rows] = again
            start = int(rows[changed[0]])
    cache.n = p0 + n
    back = torch.nonzero(fall)[:, 0]
    if len(back):
        river[back] = _logits(model, hback[back], None)
    return river, fall, passes, ent


def prefilled(model: RiverModel, chunk: list, policy: Policy) -> list[Cache]:
    """A cache per (prompt, tokens, ...) item of chunk, sized for both, with the prompts decoded under `policy`: where
    every online check, one-pass or step by step, starts."""
    caches = [model.new_cache(len(p) + len(t) + 1) for p, t, *_ in chunk]
    model.step([(p, c) for (p, *_), c in zip(chunk, caches)], policy, per_sequence=True)
    return caches
