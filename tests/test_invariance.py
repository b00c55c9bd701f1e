"""Batch-invariant decoding (patches/0013): with it on, every row's logits are bit-identical whether the token is
decoded alone, in a batch of 2..16 or in any prompt chunking, for every weight type the backbone ships in, with
ggml's extra buffer types on and off; exact mode then writes one-token decoding's text by construction."""
from __future__ import annotations

import numpy as np
import pytest

from river_edge.gguf_tools.tiny import write_tiny_model
from river_edge.runtime.llama import RiverLlama

from conftest import ARCHS

capi = pytest.importorskip("river_edge.runtime.capi")
pytestmark = pytest.mark.skipif(not capi.runtime_is_patched(), reason="needs the patched llama-cpp-python")

TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"]
N = 24


@pytest.fixture(scope="module", params=[(a, t) for a in ("llama", "qwen2", "qwen3") for t in TYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def typed(request, tmp_path_factory):
    arch, wtype = request.param
    d = tmp_path_factory.mktemp("invariance")
    return write_tiny_model(d / f"{arch}-{wtype}.gguf", arch, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                            wtype=wtype, seed=5, tie_embeddings=arch != "llama")


def _rows(llm, toks, sizes) -> np.ndarray:
    """Logits of every position with the tokens decoded in chunks of these sizes (cycled)."""
    llm.reset()
    i, j = 0, 0
    while i < len(toks):
        n = sizes[j % len(sizes)]
        llm.eval(toks[i:i + n])
        i, j = i + n, j + 1
    return np.array(llm.scores[:len(toks)])


@pytest.mark.parametrize("extra_bufts", [True, False], ids=["extra_bufts", "no_extra_bufts"])
def test_a_row_has_the_same_bits_in_any_batch(typed, extra_bufts):
    llm = RiverLlama(str(typed), mode="backbone", n_ctx=256, n_threads=2, logits_all=True, extra_bufts=extra_bufts)
    toks = [int(t) for t in np.random.default_rng(3).integers(3, llm.n_vocab(), N)]
    alone = _rows(llm, toks, [1])
    if llm._departing:   # repacked where the batched kernel departs (k-quants: Q4_K on x86, more on ARM): said so,
        # and it does depart
        assert not llm.batch_invariant and typed.stem.rsplit("-", 1)[1] in ("q4_k", "q5_k", "q6_k")
        assert any(not np.array_equal(_rows(llm, toks, [b]), alone) for b in (4, 8, 16))
        return
    assert llm.batch_invariant   # the backbone mode's default
    for b in range(2, 17):
        assert np.array_equal(_rows(llm, toks, [b]), alone), f"batches of {b}"
    assert np.array_equal(_rows(llm, toks, [5, 1, 3, 16, 2]), alone), "mixed chunking"
    assert np.array_equal(_rows(llm, toks, [N]), alone), "one prompt batch"


@pytest.mark.parametrize("wtype", ["f16", "q8_0"])
def test_a_row_has_the_same_bits_in_any_batch_with_flash_attention(tmp_path, wtype):
    """Flash attention has three CPU paths (a KV split for one row, one chunk, tiles from 64 rows); invariance keeps
    the one-chunk path for all, so a prompt of 80 tokens in one batch and token by token agree too."""
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3", n_embd=256, n_head=4, n_head_kv=2, n_ff=512, wtype=wtype,
                            seed=6, tie_embeddings=True)
    llm = RiverLlama(str(path), mode="backbone", n_ctx=256, n_threads=2, logits_all=True, flash_attn=True)
    assert llm.batch_invariant
    toks = [int(t) for t in np.random.default_rng(7).integers(3, llm.n_vocab(), 80)]
    alone = _rows(llm, toks, [1])
    for sizes in ([80], [64, 16], [3, 16, 9]):
        assert np.array_equal(_rows(llm, toks, sizes), alone), sizes


def test_without_it_batches_round_differently(tiny_llama):
    """The case the patch exists for: without invariance an F16 backbone (llamafile's sgemm for batches, vec_dot for
    one row) gives a batch's rows other bits than one-token decoding (so this test file can fail)."""
    llm = RiverLlama(str(tiny_llama), mode="backbone", n_ctx=256, n_threads=2, logits_all=True, extra_bufts=False,
                     batch_invariant=False)
    assert not llm.batch_invariant
    toks = [int(t) for t in np.random.default_rng(3).integers(3, llm.n_vocab(), N)]
    alone = _rows(llm, toks, [1])
    assert any(not np.array_equal(_rows(llm, toks, [b]), alone) for b in (2, 4, 8, 16))


@pytest.mark.parametrize("fixture", [f"tiny_{a}" for a in ARCHS])
def test_exact_is_one_token_decoding_over_512_tokens_with_random_k(request, fixture):
    path = request.getfixturevalue(fixture)
    ref = RiverLlama(str(path), mode="backbone", n_ctx=1024, n_threads=2)
    ex = RiverLlama(str(path), mode="exact", n_ctx=1024, n_threads=2)
    r = np.random.default_rng(4)
    ex.modes.draft_k = lambda: int(r.integers(0, 9))
    prompt = [1, 5, 9, 200, 17]
    # the reference one token at a time: llama-cpp-python's eval of a single token per call
    ref.reset()
    ref.eval(prompt)
    want = []
    for _ in range(512):
        t = int(ref.last_logits().argmax())
        want.append(t)
        ref.eval([t])
    got = [t for _, t in zip(range(512), ex.generate(prompt, temp=0.0))]
    assert got == want
    s = ex.stats()
    assert s["batch_invariant"] and s["settled_ties"] == 0 and s["drafted"] > 100
    assert max(s["cost_model"]["batch_deviation"]) == 0.0   # the start-up probe's check: no batch departs


def test_a_cached_prompt_gives_a_fresh_calls_text(tiny_llama):
    """A prompt asked twice: the second call reuses the cached prefix and decodes its last token alone; with
    invariance its text is the fresh call's, in backbone and exact mode."""
    for mode in ("backbone", "exact"):
        llm = RiverLlama(str(tiny_llama), mode=mode, n_ctx=512, n_threads=2)
        p = "the river runs to the sea and the sea runs to the river"
        a = llm.create_completion(p, max_tokens=64, temperature=0)["choices"][0]["text"]
        b = llm.create_completion(p, max_tokens=64, temperature=0)["choices"][0]["text"]
        assert a == b, mode
