"""Recording: the backbone decodes greedily in the reference; for every decode token and layer l, the
paper's signal s_l = cos(h_l, h_l+1) (also without the massive-activation dimensions), and what exiting
after l costs against the backbone (KL, top-1 agreement, the exit's entropy), the river attending to the
backbone's cache ("clean": all layers at once, cheap). The decode runs on as far as the online checks go
(Settings.online_tokens) and their reference log-probs are kept."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..reference import Cache, Policy, RiverModel
from ..reference.llama import rms_norm
from .target import Settings


@dataclass
class Trace:
    """Per decode token (rows) and layer (columns); the column L-1 of the damage is exact zero."""
    sims: np.ndarray          # s_l
    sims_nomassive: np.ndarray
    kl: np.ndarray            # clean KL(backbone || exit after l)
    agree: np.ndarray         # clean top-1 agreement of exit after l
    entropy: np.ndarray       # entropy of the exit-after-l distribution (the river's own uncertainty)
    prompt_of: np.ndarray     # prompt index of every row


def kl_div(logp_ref: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    logq = torch.log_softmax(logits, -1)
    return (logp_ref.exp() * (logp_ref - logq)).sum(-1).clamp_min(0)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, -1)
    return -(lp.exp() * lp).sum(-1)


def decode_backbone(model: RiverModel, prompts: list[list[int]], n: int, hidden_steps: int | None = None):
    """Greedy backbone decoding in lockstep: caches, decoded tokens, and per step h_0..h_L (of the first
    hidden_steps steps; default all) and logits."""
    size = max(map(len, prompts)) + n + 1  # one size: _clean_exits stacks the caches
    caches = [model.new_cache(size) for _ in prompts]
    if not model.emulate:   # every cache a view of one tensor [L, B, G, size, D], for the batched steps' attention
        a = model.args
        K, V = torch.zeros(2, a.n_layer, len(prompts), a.n_head_kv, size, a.head_dim)
        for b, c in enumerate(caches):
            c.k, c.v = K[:, b].transpose(1, 2), V[:, b].transpose(1, 2)   # the Cache's [L, size, G, D]
    st = model.step(list(zip(prompts, caches)), Policy.backbone(), per_sequence=True)
    last = torch.stack([lg[-1] for lg in st.logits])
    toks, hid, logits, pos = [], [], [], []
    for _ in range(n):
        nxt = last.argmax(-1).tolist()
        pos.append([c.n for c in caches])
        if model.emulate:   # (ggml's rounding: RiverModel.step's attention has it)
            st = model.step([([t], c) for t, c in zip(nxt, caches)], Policy.backbone(), per_sequence=True,
                            keep_hidden=True)
            h, last = st.hidden, torch.cat(st.logits)
        else:
            h, last = _backbone_step(model, K, V, nxt, torch.tensor(pos[-1]),
                                     hidden_steps is None or len(hid) < hidden_steps)
            for c in caches:
                c.n += 1
        toks.append(nxt)
        if hidden_steps is None or len(hid) < hidden_steps:
            hid.append(h)                           # [L+1, B, d]
        logits.append(last)
    return caches, toks, torch.stack(hid, 2), torch.stack(logits, 1), torch.tensor(pos).T


@torch.no_grad()
def _backbone_step(model: RiverModel, K: torch.Tensor, V: torch.Tensor, tokens: list[int], pos: torch.Tensor,
                   keep_hidden: bool = True):
    """One token per sequence through the backbone, the sequences' caches stacked (K, V: [L, B, G, size, D], so that
    a layer's keys are one batched matrix product's operand as they lie): what RiverModel.step does with the backbone
    policy, in one attention per layer where it runs one per sequence (their many small operations were most of a
    step). Returns h_0..h_L [L+1, B, d] (None without keep_hidden) and the logits [B, vocab]."""
    a, B = model.args, len(tokens)
    rep, S, rows = a.n_head // a.n_head_kv, int(pos.max()) + 1, torch.arange(B)
    back = pos[:, None] - torch.arange(S)[None, :]              # query position - key position, [B, S]
    h = model.backbone[0].embed(a, model.tok_embd[torch.tensor(tokens, dtype=torch.long)])
    hidden = [h.clone()] if keep_hidden else None
    for il, blk in enumerate(model.backbone):
        masked = (back < 0) | (back >= blk.window) if blk.window else back < 0

        def attend(q, k, v, il=il, blk=blk, masked=masked):
            K[il][rows, :, pos], V[il][rows, :, pos] = k, v
            qg = q.view(B, a.n_head_kv, rep, a.head_dim)
            sc = torch.matmul(qg, K[il, :, :, :S].transpose(-1, -2)) * blk.kq_scale     # [B, G, rep, S]
            pr = torch.softmax(sc.masked_fill(masked[:, None, None, :], float("-inf")), -1)
            return torch.matmul(pr, V[il, :, :, :S]).reshape(B, a.n_head, a.head_dim)
        h = blk(h, pos, attend)
        if keep_hidden:
            hidden.append(h.clone())
    logits = model.head(rms_norm(h, model.out_norm, a.eps))
    if a.softcap:
        logits = torch.tanh(logits / a.softcap) * a.softcap
    return torch.stack(hidden) if keep_hidden else None, logits


def clean_exits(model: RiverModel, caches: list[Cache], hid: torch.Tensor, pos: torch.Tensor, layers):
    """Logits of exiting after each l in `layers` for every decode row, the river attending to the
    backbone's cache for earlier positions and to its own K/V at the token's position."""
    a, L = model.args, model.args.n_layer
    B, T = pos.shape
    rep, scale = a.n_head // a.n_head_kv, a.head_dim ** -0.5
    S = int(pos.max()) + 1
    past = torch.arange(S)[None, None, None, :] < pos[:, None, None, :, None]   # [B, 1, 1, T, S]: s < p
    for e in layers:
        h = hid[e + 1].reshape(B * T, -1).clone()
        for il in range(e + 1, L):
            def attend(q, k, v, il=il):
                q = q.view(B, T, a.n_head_kv, rep, a.head_dim)
                k, v = k.view(B, T, a.n_head_kv, 1, a.head_dim), v.view(B, T, a.n_head_kv, 1, a.head_dim)
                K = torch.stack([c.k[il, :S] for c in caches])                      # [B, S, G, D]
                V = torch.stack([c.v[il, :S] for c in caches])
                s = torch.einsum("btgrd,bsgd->bgrts", q, K) * scale
                s = s.masked_fill(~past, float("-inf"))
                own = torch.einsum("btgrd,btgrd->bgrt", q, k.expand_as(q))[..., None] * scale
                pr = torch.softmax(torch.cat([s, own], -1), -1)
                o = torch.einsum("bgrts,bsgd->btgrd", pr[..., :S], V) + pr[..., S].permute(0, 3, 1, 2)[..., None] * v
                return o.reshape(B * T, a.n_head, a.head_dim)
            h = model.river[il](h, pos.reshape(-1), attend)
        yield e, model.head(rms_norm(h, model.out_norm, a.eps)).reshape(B, T, -1)


def massive_dims(hid: torch.Tensor, k: int = 4, ratio: float = 20.0) -> list[int]:
    """The few dimensions whose mean |h| dwarfs the median one in some layer (SmolLM2: 17, Qwen2.5: 490)."""
    m = hid[1:].abs().flatten(1, -2).mean(1)                     # [L, d]
    r = (m / m.median(-1, keepdim=True).values).amax(0)          # worst ratio over layers, per dim
    top = torch.topk(r, k)
    return sorted(int(i) for v, i in zip(top.values, top.indices) if v > ratio)


# Prompts the backbone decodes in lockstep. A decode step is one token per prompt and reads every weight: 8 rows or
# 16 cost about the same (a 576x1536 product, 8 rows 0.45 ms, 16 rows 0.54 ms on the AMD EPYC Zen 4 host, 2 cores),
# so the calibration decodes its fit and test prompts together, 16 at a time (Settings.batch, 8, is the checks').
DECODE_WIDTH = 16


@dataclass
class Decoded:
    """One prompt's greedy backbone decode: its cache (the backbone's K/V), tokens, the log-probs of every step, and of
    the first decode_tokens steps (the recorded ones) h_0..h_L [L+1, T, d], logits and positions."""
    prompt: list[int]
    cache: Cache
    tokens: list[int]
    logp: torch.Tensor
    hid: torch.Tensor
    logits: torch.Tensor
    pos: torch.Tensor


def decode(model: RiverModel, prompts: list[list[int]], s: Settings,
           tick: Callable[[int], None] = lambda n: None) -> list[Decoded]:
    """The backbone decoding the prompts greedily, DECODE_WIDTH at a time, as far as the online checks go
    (online_tokens); what record() needs of each, cut to the first decode_tokens where only those are recorded."""
    T, out = s.decode_tokens, []
    for b0 in range(0, len(prompts), DECODE_WIDTH):
        batch = prompts[b0:b0 + DECODE_WIDTH]
        caches, toks, hid, logits, pos = decode_backbone(model, batch, max(T, s.online_tokens), hidden_steps=T)
        logp = torch.log_softmax(logits, -1)                       # [B, n, V]
        out += [Decoded(p, caches[i], [t[i] for t in toks], logp[i], hid[:, i, :T], logits[i, :T].clone(),
                        pos[i, :T]) for i, p in enumerate(batch)]
        del logits
        tick(len(batch))
    return out


def decode_batches(model: RiverModel, prompts: list[list[int]], s: Settings, ref: dict,
                   decoded: list[Decoded] | None = None):
    """The prompts' backbone decodes (decode(), unless given), s.batch at a time; ref[i] = (prompt, tokens,
    log-probs) over all of them, and per batch (b0, batch, caches, hid, logits, pos, logp) cut to the first
    decode_tokens, the tokens whose signals are recorded."""
    T = s.decode_tokens
    decoded = decode(model, prompts, s) if decoded is None else decoded
    for b0 in range(0, len(prompts), s.batch):
        batch, ds = prompts[b0:b0 + s.batch], decoded[b0:b0 + s.batch]
        for i, d in enumerate(ds):
            ref[b0 + i] = (d.prompt, d.tokens, d.logp)
        hid = torch.stack([d.hid for d in ds], 1)
        logp = torch.stack([d.logp[:T] for d in ds])
        yield (b0, batch, [d.cache for d in ds], hid, torch.stack([d.logits for d in ds]),
               torch.stack([d.pos for d in ds]), logp)


def record(model: RiverModel, prompts: list[list[int]], s: Settings, tick: Callable[[int], None] = lambda n: None,
           massive: list[int] | None = None, decoded: list[Decoded] | None = None) -> tuple[Trace, dict]:
    """The backbone decoding the prompts once, and per recorded decode token: the paper's signal at every layer
    (also without the massive dimensions), the clean cost of exiting after every layer (a Trace, for the rule),
    and the all-river figures of the gated mode's gate (aux["gate"]: KL, agreement, entropy, top-1 margin);
    aux["ref"]: the backbone's tokens and log-probs for the online checks of both. decoded: the prompts' decode()
    (else it decodes them)."""
    L = model.args.n_layer
    parts, ref, gate = [], {}, {k: [] for k in ("kl", "agree", "entropy", "margin")}
    T = s.decode_tokens
    for b0, batch, caches, hid, logits, pos, logp in decode_batches(model, prompts, s, ref, decoded):
        if massive is None:
            massive = massive_dims(hid)
        top = logits.argmax(-1)
        kl = torch.zeros(len(batch), T, L)
        agree = torch.ones_like(kl)
        ent = torch.zeros_like(kl)
        ent[..., L - 1] = entropy(logits)
        for e, lg in clean_exits(model, caches, hid, pos, range(-1, L - 1)):
            if e == -1:   # all river: the gated mode's token before any fallback
                top2 = torch.softmax(lg, -1).topk(2, -1).values
                for k, v in (("kl", kl_div(logp, lg)), ("agree", (lg.argmax(-1) == top).float()),
                             ("entropy", entropy(lg)), ("margin", top2[..., 0] - top2[..., 1])):
                    gate[k].append(v.flatten())
                continue
            kl[..., e], agree[..., e], ent[..., e] = kl_div(logp, lg), (lg.argmax(-1) == top).float(), entropy(lg)
        h0, h1 = hid[:-1], hid[1:]                                 # [L, B, T, d]
        cos = torch.nn.functional.cosine_similarity(h0, h1, dim=-1).permute(1, 2, 0)
        keep = torch.ones(hid.shape[-1], dtype=torch.bool)
        keep[massive] = False
        cosm = torch.nn.functional.cosine_similarity(h0[..., keep], h1[..., keep], dim=-1).permute(1, 2, 0)
        idx = torch.arange(b0, b0 + len(batch))[:, None].expand(-1, T)
        parts.append([cos, cosm, kl, agree, ent, idx])
        tick(len(batch))
    cat = [torch.cat([p[j] for p in parts]).reshape(-1, *parts[0][j].shape[2:]).numpy() for j in range(6)]
    gate = {k: torch.cat(v).numpy().astype(np.float64) for k, v in gate.items()}
    return Trace(*cat[:5], prompt_of=cat[5]), {"massive": massive, "ref": ref, "gate": gate}
