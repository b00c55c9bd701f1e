"""The device check's pieces that run anywhere (bench/device_bench.py):
the shape model, the rule's depth matched to a target, the projection through the cost model, and the
host-side share of an exact cycle. The check itself runs on a GPU machine (docs/backends.md)."""
from __future__ import annotations


import numpy as np
import pytest

from bench import device_bench as D


def test_shape_model_has_the_shape(tmp_path):
    from river_edge.gguf_tools.inspect import inspect_gguf
    from river_edge.gguf_tools.reader import open_gguf, value

    shape = dict(arch="qwen2", n_layer=3, n_embd=64, n_ff=96, n_head=4, n_head_kv=2, vocab=1000, tie_embeddings=True)
    p = D.shape_model(tmp_path / "s.river.gguf", shape)
    r = open_gguf(p)
    assert [value(r, f"qwen2.{k}") for k in ("block_count", "embedding_length", "feed_forward_length",
                                             "attention.head_count", "attention.head_count_kv")] == [3, 64, 96, 4, 2]
    assert len(value(r, "tokenizer.ggml.tokens")) == 1000
    names = {t.name: t.tensor_type.name for t in r.tensors}
    assert "output.weight" not in names and names["blk.0.attn_q.weight"] == "F16"
    assert names["river.blk.0.attn_q.weight"] == "Q4_0" and inspect_gguf(p)["river"]


@pytest.mark.parametrize("target", [2.0, 3.0])
def test_depth_thresholds_give_the_target_depth(tiny_qwen2, target):
    from river_edge.runtime.llama import RiverLlama

    llm = RiverLlama(str(tiny_qwen2), n_ctx=256, n_threads=1, seed=0)
    got = D.depth_thresholds(llm, target)
    # within an eighth of a layer of the target on this 4-layer model (24 tokens: a step of 1/24); it allowed 1.0
    assert abs(got["depth_on_scores"] - target) <= 0.125
    # the rule, run over the same steps with that threshold, exits where the scores said it would
    llm.reset_stats()
    llm.reset()
    llm.eval(llm.tokenize(D.PROMPT.encode()))
    llm.reset_stats()
    for _ in range(24):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    assert llm.mean_depth() == pytest.approx(got["depth_on_scores"], abs=1 / 24)   # one token a layer off at most


def test_projection_is_the_cost_models_choice():
    cost = {"draft_ms": 4.5, "verify_ms_used": [17.2, 20.1, 24.7, 24.7, 27.3]}
    assert D.projection(cost, 0.0) == {"acceptance": 0.0, "k": 0, "ratio": pytest.approx(1.0)}
    hi = D.projection(cost, 0.95)
    # at k drafts a cycle yields (1 - a^(k+1)) / (1 - a) tokens for k * draft + verify(k + 1)
    e = (1 - 0.95 ** (hi["k"] + 1)) / 0.05
    assert hi["ratio"] == pytest.approx(e / (hi["k"] * 4.5 + cost["verify_ms_used"][hi["k"]]) * 17.2)
    assert hi["k"] >= 2 and hi["ratio"] > 1.5
    assert D.projection(None, 0.9) == {} and D.projection(cost, None) == {}


def test_host_share_is_measured(tiny_llama):
    from river_edge.runtime.llama import RiverLlama

    llm = RiverLlama(str(tiny_llama), n_ctx=256, n_threads=1, seed=0)
    h = D.host_share(llm, 24)
    assert 0.0 < h["in_ggml_s"] < h["wall_s"] and 0.0 < h["host_share"] < 1.0
    assert h["cycles"] >= 1 and h["host_ms_per_cycle"] > 0
