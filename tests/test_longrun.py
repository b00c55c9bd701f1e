"""Long and batched runs (bench/longrun.py) on the tiny river GGUFs of both architectures.

The tiny GGUFs are uncalibrated (thresholds +inf): the river rule never exits there, so it must equal the
backbone, alone and in a batch; with thresholds of -1 it exits at every step and must not.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from bench import figures as P, longrun as LR  # noqa: E402
from river_edge.runtime import capi  # noqa: E402
from river_edge.format import RiverError  # noqa: E402

pytestmark = pytest.mark.skipif(not capi.runtime_is_patched(), reason="needs the patched llama-cpp-python")

N = 24
PROMPTS = ["What is 2 plus 2?", "Write a function.", "Tell me a long story about the sea and a boat.", "Hi"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def river_path(request, tiny_llama, tiny_qwen2):
    return tiny_llama if request.param == "llama" else tiny_qwen2


@pytest.fixture(scope="module")
def long(river_path):
    return LR.kl_along_sequence(river_path, ("backbone", "fast"), prompt=PROMPTS[0], n_tokens=N, window=8)


def test_along_sequence(long):
    assert long["n_tokens"] == N and long["ref_dtype"] == "float32"
    bb, fast = long["modes"]["backbone"], long["modes"]["fast"]
    for r in (bb, fast):
        assert len(r["kl"]) == len(r["agree"]) == N
        # one decision per decode step, the prefill not counted; backbone mode has the river off: none, every layer
        assert sum(r["hist"]) == (0 if r is bb else N)
        assert r["mean_depth"] == long["n_layer"] if r is bb else r["mean_depth"] == 0.0
        # windows cover the positions in order and average them
        assert [w["start"] for w in r["windows"]] == list(range(0, N, 8))
        for w in r["windows"]:
            np.testing.assert_allclose(w["kl_mean"], np.mean(r["kl"][w["start"]:w["start"] + 8]), rtol=1e-12)
            assert w["agreement"] == np.mean(r["agree"][w["start"]:w["start"] + 8])
        np.testing.assert_allclose(r["kl_mean"], np.mean(r["kl"]), rtol=1e-12)
        np.testing.assert_allclose(r["kl_first_quarter"], np.mean(r["kl"][:N // 4]), rtol=1e-12)
        np.testing.assert_allclose(r["kl_last_quarter"], np.mean(r["kl"][-(N // 4):]), rtol=1e-12)
    # the backbone against itself: zero up to float32 storage of its log-probs
    assert max(abs(x) for x in bb["kl"]) < 1e-6 and bb["agreement"] == 1.0
    assert bb["mean_depth"] == long["n_layer"] and fast["mean_depth"] == 0
    assert max(fast["kl"]) > 1e-3 and min(fast["kl"]) >= -1e-9


def test_along_sequence_float16_reference(river_path, long, monkeypatch):
    """Over the float32 budget the reference is float16: renormalised, KL moves by far less than a river's."""
    monkeypatch.setattr(LR, "REF_BUDGET", 0)
    r = LR.kl_along_sequence(river_path, ("backbone", "fast"), prompt=PROMPTS[0], n_tokens=N, window=8)
    assert r["ref_dtype"] == "float16"
    assert max(abs(x) for x in r["modes"]["backbone"]["kl"]) < 1e-4
    np.testing.assert_allclose(r["modes"]["fast"]["kl"], long["modes"]["fast"]["kl"], rtol=1e-2, atol=1e-4)


def test_along_sequence_rejects_untestable_mode(river_path):
    with pytest.raises(RiverError, match="teacher-forced"):
        LR.kl_along_sequence(river_path, ("exact",), prompt="x", n_tokens=4)


def test_batch_never_exiting_equals_backbone(river_path):
    b = LR.kl_in_batch(river_path, PROMPTS, n_tokens=N)
    L = b["n_layer"]
    assert b["n_seq"] == 4 and len(b["batch_exits"]) == N
    assert b["batch_exits"] == [L - 1] * N and b["batch_hist"][L] == N  # one ubatch per step of 4 tokens
    assert b["batch_mean_depth"] == b["alone_mean_depth"] == L
    for q in b["sequences"]:
        for key in ("batch", "alone"):
            assert len(q[key]["kl"]) == N
            # batch vs one-sequence decoding: float rounding only
            assert max(abs(x) for x in q[key]["kl"]) < 1e-3 and q[key]["agreement"] == 1.0


def test_batch_exiting(river_path):
    b = LR.kl_in_batch(river_path, PROMPTS, n_tokens=N, thresholds=0.0)
    L = b["n_layer"]
    assert b["thresholds"] == [0.0] * L
    assert all(e < L - 1 for e in b["batch_exits"]) and sum(b["batch_hist"]) == N
    assert b["batch_mean_depth"] < L and b["alone_mean_depth"] < L
    assert b["batch_kl_mean"] > 1e-3 and b["alone_kl_mean"] > 1e-3
    for q in b["sequences"]:
        assert sum(q["alone"]["hist"]) == N and q["alone"]["hist"][L] == 0
        assert math.isclose(q["batch"]["kl_mean"], np.mean(q["batch"]["kl"]))


def test_figure(long, river_path, tmp_path):
    b = LR.kl_in_batch(river_path, PROMPTS, n_tokens=N, thresholds=0.0)
    import matplotlib.pyplot as plt

    imgs = [plt.imread(P.longrun(*args, tmp_path / f"{i}.png"))
            for i, args in enumerate(((long, b), (None, b), (long, None)))]
    for img in imgs:   # a real figure: a picture of some size with lines and text drawn, not a blank canvas
        assert img.ndim == 3 and min(img.shape[:2]) > 200
        assert len(np.unique(img.reshape(-1, img.shape[2]), axis=0)) > 20
    # each panel is drawn from its own data: leaving one out changes the picture
    assert not np.array_equal(imgs[0], imgs[1]) and not np.array_equal(imgs[0], imgs[2])
