"""The online checks' teacher-forced decodes, every decode token of a prompt in one pass instead of one step each.

The online checks feed the backbone's own greedy tokens back (teacher forcing), so every token is known before the
check starts; only what each token does (its exit layer; the gated mode's fallback) depends on earlier tokens, and
then only through the K/V they leave at each layer. Layer by layer over all tokens at once, with causal attention,
gives the step-by-step decode's result (RiverModel.step, one token per step):
  - the rule decides a token's exit from its own backbone layers below, so at layer il every token already knows
    whether it runs the backbone's or the river's layer il, and the K/V it writes there;
  - a forced exit (random selection, all-river) is known before the pass;
  - the gated mode decides a fallback only after the token's whole river pass, which depends on the fallbacks of
    earlier tokens: a fixed point, found by passes that start from a guess (none, or an earlier check's) and repeat
    until no decision changes. A decision depends only on earlier ones, so after k passes at least the first k are
    final and the fixed point is the step-by-step answer, whatever the guess.
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


def _layer(model: RiverModel, il: int, streams: list, seqs: list) -> list[torch.Tensor]:
    """Layer il over decode tokens of one or more sequences. streams: (block, h) each, h [rows, d] the stream's rows of
    every sequence in turn; seqs: (cache, p0, pos, pick, rows) each, its n decode tokens after a cache holding p0
    positions at positions pos [n], and per stream the indices (into its n tokens) of its rows. Every token attends to
    its cache's K/V at earlier positions (the prompt's, then at each decode position the K/V of stream pick[token])
    and to its own K/V at its own position. Each stream's q, k, v are projected once for all its rows
    (Block.project), its K/V written where pick takes them, then each attends (Block.finish). Returns each stream's
    output."""
    a = model.args
    rep = a.n_head // a.n_head_kv
    qkv = [blk.project(h, torch.cat([pos[rows[s]] for _, _, pos, _, rows in seqs]))
           for s, (blk, h) in enumerate(streams)]
    if model.emulate:
        qkv = [tuple(round_f16(x) for x in t) for t in qkv]
    attn = [torch.empty(len(h), a.n_head, a.head_dim) for _, h in streams]
    off = [0] * len(streams)
    for cache, p0, pos, pick, rows in seqs:
        S = p0 + len(pos)
        K, V = cache.k[il], cache.v[il]
        own = [tuple(x[off[s]:off[s] + len(rows[s])] for x in qkv[s]) for s in range(len(streams))]
        for s, (_, k, v) in enumerate(own):
            mine = pick[rows[s]] == s
            K[p0 + rows[s][mine]], V[p0 + rows[s][mine]] = k[mine], v[mine]
        K, V = K[:S], V[:S]
        for s, ((blk, _), (q, k, v)) in enumerate(zip(streams, own)):
            t = len(rows[s])
            if t:
                back = pos[rows[s]][:, None] - torch.arange(S)[None, :]          # query position - key position
                masked = (back <= 0) | (back >= blk.window) if blk.window else back <= 0   # earlier keys; its own apart
                qg = q.view(t, a.n_head_kv, rep, a.head_dim)
                sc = torch.einsum("tgrd,sgd->grts", qg, K) * blk.kq_scale
                sc = sc.masked_fill(masked, float("-inf"))
                mk = torch.einsum("tgrd,tgd->grt", qg, k)[..., None] * blk.kq_scale
                pr = torch.softmax(torch.cat([sc, mk], -1), -1)
                if model.emulate:
                    pr = round_f16(pr)
                o = torch.einsum("grts,sgd->tgrd", pr[..., :S], V) \
                    + pr[..., S].permute(2, 0, 1)[..., None] * v[:, :, None]
                attn[s][off[s]:off[s] + t] = o.reshape(t, a.n_head, a.head_dim)
            off[s] += t
    return [blk.finish(h, at) for (blk, h), at in zip(streams, attn)]


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
        outs = _layer(model, il, [(blk, hin) for blk, hin, _ in streams],
                      [(cache, p0, pos, pick, [rows for _, _, rows in streams])])
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
    entropy per token). gated_passes() for one sequence."""
    return gated_passes(model, [cache], [tokens], gate, entropy, window, [guess])[0]


@torch.no_grad()
def gated_passes(model: RiverModel, caches: Sequence[Cache], tokens: Sequence[Sequence[int]], gate: float, entropy,
                 window: int = WINDOW, guesses: Sequence[torch.Tensor | None] | None = None) -> list[tuple]:
    """gated_pass() for several sequences (each its cache and tokens) at once: each runs its own passes, and a pass
    of every unsettled sequence goes through each weight in one product (one sequence's pass is 64 rows or fewer,
    where a product of a few hundred rows runs faster per row). Returns gated_pass()'s tuple per sequence.

    Each sequence's tokens go `window` at a time; each pass over a window starts at the first token whose decision
    the last one changed (those before it are final, their K/V in the cache) and runs the backbone only for the
    tokens it takes to fall back. A window's first pass guesses its fallbacks: guesses[j] (a bool per token, e.g. an
    earlier check's entropies against this gate), else none. The answer does not depend on the guess (every pass
    settles at least its first token), the passes do: a window settles in a pass or two more than the guesses it got
    wrong in a chain; guessing "none" is wrong at every token that falls back, and takes a pass more per window."""
    L, emb = model.args.n_layer, model.backbone[0].embed
    seqs = []
    for j, (cache, t) in enumerate(zip(caches, tokens)):
        n, g = len(t), guesses[j] if guesses is not None else None
        x = emb(model.args, model.tok_embd[torch.tensor(t, dtype=torch.long)])
        seqs.append(dict(cache=cache, p0=cache.n, pos=cache.n + torch.arange(n), n=n, x=x, hback=torch.empty_like(x),
                         fall=g.clone() if g is not None else torch.zeros(n, dtype=torch.bool), ent=torch.empty(n),
                         river=None, passes=0, window=0, start=0))
    live = [q for q in seqs if q["n"]]
    while live:
        rows, brows = [], []
        for q in live:
            q["passes"] += 1
            rows.append(torch.arange(q["start"], min(q["window"] + window, q["n"])))
            brows.append(rows[-1][q["fall"][rows[-1]]])
        hr = torch.cat([q["x"][r] for q, r in zip(live, rows)])
        hb = torch.cat([q["x"][r] for q, r in zip(live, brows)])
        nb = len(hb)
        for il in range(L):
            streams = [(model.river[il], hr)] + ([(model.backbone[il], hb)] if nb else [])
            out = _layer(model, il, streams, [(q["cache"], q["p0"], q["pos"], q["fall"].long(), [r, b] if nb else [r])
                                              for q, r, b in zip(live, rows, brows)])
            hr, hb = out[0], out[-1] if nb else hb
        lr = _logits(model, hr, torch.arange(len(hr)))
        ent = entropy(lr)
        o = ob = 0
        for q, r, b in zip(live, rows, brows):
            if q["river"] is None:
                q["river"] = torch.empty(q["n"], lr.shape[1])
            # the backbone's logits once, at the end, for the final fallbacks
            q["river"][r], q["ent"][r], q["hback"][b] = lr[o:o + len(r)], ent[o:o + len(r)], hb[ob:ob + len(b)]
            o, ob = o + len(r), ob + len(b)
            again = q["ent"][r] >= gate
            changed = torch.nonzero(again != q["fall"][r])[:, 0]
            if len(changed):
                # the first changed decision is final (every one before it is); the rest are the next pass's guess
                q["fall"][r] = again
                q["start"] = int(r[changed[0]])
            else:
                q["window"] = q["start"] = int(r[-1]) + 1
        live = [q for q in live if q["window"] < q["n"]]
    out = []
    for q in seqs:
        q["cache"].n = q["p0"] + q["n"]
        back = torch.nonzero(q["fall"])[:, 0]
        if len(back):
            q["river"][back] = _logits(model, q["hback"][back], None)
        out.append((q["river"], q["fall"], q["passes"], q["ent"]))
    return out


def prefilled(model: RiverModel, chunk: list, policy: Policy) -> list[Cache]:
    """A cache per (prompt, tokens, ...) item of chunk, sized for both, with the prompts decoded under `policy`: where
    every online check, one-pass or step by step, starts."""
    caches = [model.new_cache(len(p) + len(t) + 1) for p, t, *_ in chunk]
    model.step([(p, c) for (p, *_), c in zip(chunk, caches)], policy, per_sequence=True)
    return caches
