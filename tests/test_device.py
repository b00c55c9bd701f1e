"""The runtime's invariants on a device backend. RIVER_TEST_DEVICE names it; without it these tests are collected
and skipped, one skip each (`make test` runs the CPU build; its summary counts them under this reason). With it, a
missing device is a failure, not a skip.

- vulkan (`make test-vulkan`): ggml's Vulkan backend (on a machine without a GPU, Mesa's lavapipe).
- rpc (`make test-rpc`): ggml's RPC backend, two `river rpc-server`s on 127.0.0.1 in child processes.
- cuda (`bench/device_check.py` on a GPU machine): ggml's CUDA backend.

Each with all layers offloaded, and half of them (the graph split between the device(s) and the local CPU).
Comparisons are between two runs on the same devices and split: river off against the stock model, a forced
exit against a stock GGUF whose later layers carry the river weights, exact mode against the backbone's
greedy tokens.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from conftest import ARCHS
from test_runtime import PROMPT, greedy, mixed_thresholds, rule_exit   # as the CPU invariants

DEVICE = os.environ.get("RIVER_TEST_DEVICE")
pytestmark = pytest.mark.skipif(DEVICE is None, reason="device tests run with RIVER_TEST_DEVICE "
                                                       "(make test-vulkan, make test-rpc)")

N_CTX = 128
ALL = -1   # n_gpu_layers: every layer on the device(s)
HALF = 2   # the last two layers (of 4, gemma3's 6): the graph split between the device(s) and the local CPU
# every architecture fully offloaded; split, the two first and gemma3 (its sliding-window layers on both sides)
CASES = [*ARCHS, "llama-half", "qwen2-half", "gemma3-half", "smollm2"]


@pytest.fixture(scope="module", autouse=True)
def device():
    from river_edge.host import devices

    assert DEVICE in ("vulkan", "cuda", "rpc"), f"RIVER_TEST_DEVICE={DEVICE!r}: vulkan, cuda or rpc"
    if DEVICE != "rpc":
        found = devices()
        assert any(d.lower().startswith(DEVICE) for d in found), f"no {DEVICE} device: {found}"
        yield found
        return
    from river_edge.runtime.rpc import connect, local_servers

    with local_servers(2) as endpoints:
        assert connect(endpoints) == 2
        found = devices()
        assert sum(d.startswith("RPC") for d in found) == 2, found
        yield found   # local_servers frees the models left before the servers stop


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory):
    if request.param == "smollm2":
        # a real model (from the package index on a fresh machine), its river uncalibrated: these invariants
        # need no thresholds; all 30 layers offloaded
        from river_edge import zoo
        from river_edge.gguf_tools.build import build_river

        return build_river(zoo.prepare("smollm2-135m"), tmp_path_factory.mktemp("smollm2") / "river.gguf"), ALL
    arch, _, half = request.param.partition("-")
    return request.getfixturevalue(f"tiny_{arch}"), HALF if half else ALL


def river(path, gpu, **kw):
    from river_edge.runtime.llama import RiverLlama

    kw = {"logits_all": True, **kw}
    m = RiverLlama(str(path), n_ctx=N_CTX, n_threads=2, n_threads_batch=2, n_gpu_layers=gpu, **kw)
    assert m.offloaded, m.tensor_buft(f"blk.{m.n_layer - 1}.attn_q.weight")   # the last layers went to the device
    return m


def stock(path, gpu):
    import llama_cpp

    from river_edge.tokenizer import quiet_llama_logs

    with quiet_llama_logs():
        return llama_cpp.Llama(str(path), n_ctx=N_CTX, n_threads=2, n_threads_batch=2, logits_all=True,
                               n_gpu_layers=gpu, verbose=False)


def test_river_off_is_the_stock_model(case, tmp_path):
    from river_edge.gguf_tools.convert import plain

    path, gpu = case
    want_toks, want = greedy(stock(plain(path, tmp_path / "backbone.gguf", "backbone"), gpu))
    m = river(path, gpu)   # thresholds +inf: the river never exits
    toks, got = greedy(m)
    assert toks == want_toks
    if gpu == ALL or DEVICE == "rpc":
        assert got.tobytes() == want.tobytes()
    else:
        # split with the CPU on Vulkan: ggml-vulkan fuses ops across a layer boundary differently when the river's
        # (skipped) nodes sit between two layers; the last bits differ (lavapipe: 1.8e-7 of the largest logit),
        # and with GGML_VK_DISABLE_FUSION=1 it is bit for bit
        assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-6
    assert m.thresholds == [math.inf] * m.n_layer


def test_forced_exit_is_the_swapped_stock_model(case, tmp_path):
    from gguf_edit import swapped

    path, gpu = case
    L = river(path, gpu).n_layer
    for e in (-1, 0, L // 2, L - 2):
        m = river(path, gpu, forced_exit=e)
        got = greedy(m)[1]
        assert m.last_exit == e
        want = greedy(stock(swapped(path, tmp_path / f"swapped{e}.gguf", range(e + 1, L), head=e == -1), gpu))[1]
        # llama: bit for bit; qwen2 within 1.4e-6 of logits of magnitude ~5 on lavapipe (its bias adds fuse
        # differently in the two graphs), far below any exit's effect
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err <= 1e-6, (e, err)


def test_exact_is_the_backbone(case):
    path, gpu = case
    ref = river(path, gpu, mode="backbone", logits_all=False)
    ex = river(path, gpu, mode="exact", logits_all=False)   # logits_all asks for logprobs: no speculation
    ex.decoding.draft_k = 3   # drafts every cycle whatever the cost model says (on lavapipe it says k = 0)
    want = [t for _, t in zip(range(32), ref.generate(PROMPT, temp=0.0))]
    g = ex.generate(PROMPT, temp=0.0)
    got = [next(g) for _ in range(32)]
    g.close()
    assert got == want and ex.stats()["drafted"] > 0
    # batch invariance covers the CPU backend only: with layers on a device it is not claimed (the guard decides)
    assert not ex.batch_invariant


def test_lagged_rule(case):
    """The lagged rule on the device: each step's exit is the rule on the scores read after the previous step (one
    read per backend: a split model has two), and forcing the same exits step by step gives the same logits."""
    path, gpu = case
    make = lambda p, **kw: river(p, gpu, **kw)   # noqa: E731
    L = make(path).n_layer
    tau = mixed_thresholds(path, L, 0, 24, make)
    m = make(path, thresholds=tau, min_exit_layer=0, decide="lagged")
    toks, feed, prev, exits = list(PROMPT), PROMPT, None, []
    for step in range(25):
        m.eval(feed)
        d = rule_exit(prev, tau, 0, L, L - 2) if prev is not None else None
        assert m.last_exit == (d if d is not None else L - 1), (step, m.last_exit, prev)
        prev = m.last_scores()
        exits.append(m.last_exit)
        toks.append(int(np.argmax(m.scores[m.n_tokens - 1])))
        feed = [toks[-1]]
    assert min(exits) < L - 1, exits
    f = make(path)
    for i, e in enumerate(exits):
        f.force_exit(e)
        f.eval(toks[: len(PROMPT)] if i == 0 else [toks[len(PROMPT) + i - 1]])
    got, want = np.array(f.scores[: f.n_tokens]), np.array(m.scores[: m.n_tokens])
    # Vulkan fuses neighbouring ops differently when the river's scores run between its layers (see above)
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= (0 if DEVICE == "rpc" else 1e-6)
