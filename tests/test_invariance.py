"""Batch-invariant verification (patches/0013): a verification batch run on ggml's reference kernels gives every row
the bits of decoding that token alone on the stock kernels, for every weight type the backbone ships in, with ggml's
extra buffer types on and off; the prompt and one-token steps keep the stock kernels, so exact mode writes what the
stock runtime (llama_cpp.Llama on the same file) writes, token for token and cell for cell."""
from __future__ import annotations

import platform

import llama_cpp
import numpy as np
import pytest

from river_edge.gguf_tools.tiny import write_tiny_model
from river_edge.runtime.capi import model_params
from river_edge.runtime.llama import RiverLlama

from conftest import ARCHS

capi = pytest.importorskip("river_edge.runtime.capi")
pytestmark = pytest.mark.skipif(not capi.runtime_is_patched(), reason="needs the patched llama-cpp-python")

TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k"]   # q4_1, q5_0: SmolLM2, Qwen2.5-0.5B
N, P = 40, 8     # tokens, of which the first P are a prompt (one stock batch)


@pytest.fixture(scope="module", params=[(a, t) for a in ("llama", "qwen2", "qwen3") for t in TYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def typed(request, tmp_path_factory):
    arch, wtype = request.param
    d = tmp_path_factory.mktemp("invariance")
    return write_tiny_model(d / f"{arch}-{wtype}.gguf", arch, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                            wtype=wtype, seed=5, tie_embeddings=arch != "llama")


def _system() -> str:
    return llama_cpp.llama_print_system_info().decode(errors="replace")


def _alone(llm, toks, p0=P) -> np.ndarray:
    """Logits of positions p0.. as the stock runtime decodes them: the prompt toks[:p0] in one batch, then one token
    at a time."""
    dec = llm.decoder
    dec.remove(0)
    out = [np.array(dec.decode(toks[:p0], 0)[0])] if p0 else []
    out += [np.array(dec.decode([toks[i]], i)[0]) for i in range(p0, len(toks) - 1)]
    return np.stack(out)


def _verified(llm, toks, sizes, invariant=True, p0=P) -> np.ndarray:
    """The same positions' logits with the tokens after the prompt decoded in verification batches of these sizes
    (cycled)."""
    dec = llm.decoder
    dec.remove(0)
    out = [np.array(dec.decode(toks[:p0], 0)[0])] if p0 else []
    i, j = p0, 0
    while i < len(toks) - 1:
        n = min(sizes[j % len(sizes)], len(toks) - 1 - i)
        out += list(np.array(dec.verify(toks[i:i + n], i, invariant)))
        i, j = i + n, j + 1
    return np.stack(out)


def _stock(path, toks, extra_bufts, **kw) -> np.ndarray:
    """llama_cpp.Llama's own logits for the same prompt and one-token steps, as a user runs it (without logits_all,
    which would put the whole prompt through the LM head as a batch)."""
    with model_params(use_extra_bufts=extra_bufts):
        ref = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False, **kw)
    out = []
    for chunk in [toks[:P]] + [[t] for t in toks[P:-1]]:
        ref.eval(chunk)
        out.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ref.ctx, -1), shape=(ref.n_vocab(),)).copy())
    return np.stack(out)


@pytest.mark.parametrize("extra_bufts", [True, False], ids=["extra_bufts", "no_extra_bufts"])
def test_a_verified_row_has_the_same_bits_as_alone(typed, extra_bufts):
    llm = RiverLlama(str(typed), mode="backbone", n_ctx=256, n_threads=2, extra_bufts=extra_bufts)
    toks = [int(t) for t in np.random.default_rng(3).integers(3, llm.n_vocab(), N)]
    alone = _alone(llm, toks)
    # the reference itself: the stock runtime's prompt batch and one-token steps
    assert np.array_equal(alone, _stock(typed, toks, extra_bufts))
    if llm.departing:   # repacked where the batched kernel departs (k-quants on x86 and ARM): said so, and it does
        assert not llm.batch_invariant and typed.stem.rsplit("-", 1)[1] in ("q4_k", "q5_k", "q6_k")
        assert any(not np.array_equal(_verified(llm, toks, [b]), alone) for b in (4, 8, 16))
        # below 4 rows the repacked matmul takes a lone row's kernel: exact mode verifies that many, bit for bit
        assert llm.exact_batch == 3
        for b in (2, 3):
            assert np.array_equal(_verified(llm, toks, [b]), alone), f"batches of {b}"
        return
    assert llm.batch_invariant   # the default
    if extra_bufts and typed.stem.endswith("-q4_k") and platform.machine() in ("x86_64", "AMD64"):
        # Q4_K in ggml's repacked layout, whose 4-row gemm departs from its gemv: these rows take patches/0019's kernels
        # (ggml repacks Q4_K only where the CPU variant has AVX2; elsewhere it stays in the mapped file)
        assert (capi.tensor_buft(llm, "blk.0.ffn_up.weight") == "CPU_REPACK") == ("AVX2 = 1" in _system())
    for b in range(2, 17):
        assert np.array_equal(_verified(llm, toks, [b]), alone), f"batches of {b}"
    assert np.array_equal(_verified(llm, toks, [5, 1, 3, 9, 2]), alone), "mixed sizes"


@pytest.mark.parametrize("wtype", ["f16", "q8_0"])
def test_a_verified_row_has_the_same_bits_with_flash_attention(tmp_path, wtype):
    """Flash attention has three CPU paths (a KV split for one row from 512 cells, one chunk, tiles from 64 rows):
    verification batches take the one-chunk path a lone row takes below 512 cells, so in a context of at most 256
    cells their rows are the lone rows'; in a larger one a lone row may split the KV, and batch_invariant says so."""
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, wtype=wtype,
                            seed=6, tie_embeddings=True)
    llm = RiverLlama(str(path), mode="backbone", n_ctx=256, n_threads=2, flash_attn=True)
    assert llm.batch_invariant
    toks = [int(t) for t in np.random.default_rng(7).integers(3, llm.n_vocab(), 90)]
    alone = _alone(llm, toks, 0)
    for sizes in ([80, 9], [64, 16, 9], [3, 16, 9]):
        assert np.array_equal(_verified(llm, toks, sizes, p0=0), alone), sizes
    assert not RiverLlama(str(path), mode="backbone", n_ctx=1024, flash_attn=True).batch_invariant


def test_without_it_batches_round_differently(tiny_llama):
    """The case the patch exists for: on the batched kernels an F16 backbone (llamafile's sgemm for batches, vec_dot for
    one row) gives a batch's rows other bits than one-token decoding (so this test file can fail)."""
    llm = RiverLlama(str(tiny_llama), mode="backbone", n_ctx=256, n_threads=2, extra_bufts=False)
    toks = [int(t) for t in np.random.default_rng(3).integers(3, llm.n_vocab(), N)]
    alone = _alone(llm, toks)
    assert any(not np.array_equal(_verified(llm, toks, [b], invariant=False), alone) for b in (2, 4, 8, 16))
    assert not RiverLlama(str(tiny_llama), n_ctx=256, batch_invariant=False).batch_invariant


@pytest.mark.parametrize("fixture", [f"tiny_{a}" for a in ARCHS])
def test_exact_is_the_stock_runtime_over_512_tokens_with_random_k(request, fixture):
    """Exact mode (k drawn at random each cycle) against llama_cpp.Llama on the same river GGUF (the stock API runs its
    backbone) fed one token at a time, 512 tokens."""
    path = request.getfixturevalue(fixture)
    ref = llama_cpp.Llama(str(path), n_ctx=1024, n_threads=2, verbose=False)
    ex = RiverLlama(str(path), mode="exact", n_ctx=1024, n_threads=2)
    r = np.random.default_rng(4)
    ex.decoding.draft_k = lambda: int(r.integers(0, 9))
    prompt = [1, 5, 9, 200, 17]
    want = [t for _, t in zip(range(512), ref.generate(prompt, temp=0.0))]
    got = [t for _, t in zip(range(512), ex.generate(prompt, temp=0.0))]
    assert got == want
    s = ex.stats()
    assert s["batch_invariant"] and s["settled_ties"] == 0 and s["drafted"] > 100
    assert max(s["cost_model"]["batch_deviation"]) == 0.0   # the start-up probe's check: no batch departs


def test_a_cached_prompt_gives_a_fresh_calls_text(tiny_llama):
    """A prompt asked twice: the second call reuses the cached prefix and decodes its last token alone, as the stock
    runtime does; backbone and exact mode write what llama_cpp.Llama writes both times."""
    p = "the river runs to the sea and the sea runs to the river"
    ref = llama_cpp.Llama(str(tiny_llama), n_ctx=512, n_threads=2, verbose=False)
    want = [ref.create_completion(p, max_tokens=64, temperature=0)["choices"][0]["text"] for _ in range(2)]
    for mode in ("backbone", "exact"):
        llm = RiverLlama(str(tiny_llama), mode=mode, n_ctx=512, n_threads=2)
        got = [llm.create_completion(p, max_tokens=64, temperature=0)["choices"][0]["text"] for _ in range(2)]
        assert got == want, mode
