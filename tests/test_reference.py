"""The PyTorch reference: the exit rule's invariants (docs/design.md §3) and agreement with llama.cpp."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from river_edge.format import RiverError
from river_edge.gguf_tools.convert import plain
from river_edge.reference import Policy, RiverModel
from river_edge.reference.ggml_numerics import unrounded_weights

from conftest import ARCHS
from gguf_edit import swapped

INF = math.inf
PROMPT = [5, 77, 120, 3, 64, 200, 18, 41, 99, 7]


@pytest.fixture(scope="module", params=ARCHS)
def river_path(request):
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture(scope="module")
def model(river_path):
    return RiverModel(river_path)


def run(model: RiverModel, policy: Policy, tokens=PROMPT) -> torch.Tensor:
    return model.step([(tokens, model.new_cache(64))], policy).logits[0]


def test_infinite_thresholds_are_the_backbone(model):
    L = model.args.n_layer
    st = model.step([(PROMPT, model.new_cache(64))], Policy(thresholds=[INF] * L, min_exit_layer=0))
    assert st.exit_layer == L - 1
    assert torch.equal(st.logits[0], run(model, Policy.backbone()))
    assert not torch.isnan(st.sims[:, : L - 1]).any()


@pytest.mark.parametrize("e", [0, 1, 2])
def test_forced_exit_is_backbone_then_river(model, river_path, tmp_path, e):
    L = model.args.n_layer
    ref = RiverModel(swapped(river_path, tmp_path / "swapped.gguf", range(e + 1, L)))
    st = model.step([(PROMPT, model.new_cache(64))], Policy(forced=e))
    assert st.exit_layer == e
    assert torch.equal(st.logits[0], run(ref, Policy.backbone()))
    assert not torch.equal(st.logits[0], run(model, Policy.backbone()))


def test_all_river_is_the_river_model(model, river_path, tmp_path):
    ref = RiverModel(plain(river_path, tmp_path / "river-only.gguf", "river"))
    assert torch.equal(run(model, Policy.all_river()), run(ref, Policy.backbone()))


def test_rule_exits_at_first_layer_over_threshold(model):
    L = model.args.n_layer
    sims = model.step([(PROMPT, model.new_cache(64))], Policy.backbone()).sims.min(0).values
    for m in range(L - 1):  # every similarity beats -1: the exit is the min exit layer
        assert model.step([(PROMPT, model.new_cache(64))], Policy(thresholds=[-1.0] * L, min_exit_layer=m)).exit_layer == m
    for target in range(1, L - 1):
        tau = [float(s) + 1e-4 for s in sims]          # just above: no exit
        tau[target] = float(sims[target]) - 1e-4       # just below: exit here
        st = model.step([(PROMPT, model.new_cache(64))], Policy(thresholds=tau, min_exit_layer=0))
        assert st.exit_layer == target
        assert torch.isnan(st.sims[:, target + 1:]).all()
    # never at the last layer: exiting there is the backbone
    assert model.step([(PROMPT, model.new_cache(64))], Policy(thresholds=[-1.0] * L, min_exit_layer=L - 1)).exit_layer == L - 1


def test_batch_exits_on_the_min_over_its_tokens(model):
    L = model.args.n_layer
    a, b = PROMPT, [9, 8, 7, 6]
    sa = model.step([(a, model.new_cache(64))], Policy.backbone()).sims.min(0).values
    sb = model.step([(b, model.new_cache(64))], Policy.backbone()).sims.min(0).values
    tau = ((sa + sb) / 2).tolist()  # between the two: whichever is higher passes, the min does not
    both = model.step([(a, model.new_cache(64)), (b, model.new_cache(64))], Policy(thresholds=tau, min_exit_layer=0))
    lo = torch.minimum(sa, sb)
    expect = next((l for l in range(L - 1) if lo[l] > tau[l]), L - 1)
    assert both.exit_layer == expect
    # per_sequence: the same as stepping each alone (without ggml's Q8 rounding of activations, whose
    # steps turn float summation-order noise into jumps)
    model = RiverModel(model.path, emulate=False)
    ca, cb = model.new_cache(64), model.new_cache(64)
    sep = model.step([(a, ca), (b, cb)], Policy(thresholds=tau, min_exit_layer=0), per_sequence=True)
    alone = [model.step([(s, model.new_cache(64))], Policy(thresholds=tau, min_exit_layer=0)) for s in (a, b)]
    assert sep.exit_layer == [x.exit_layer for x in alone]
    for got, want in zip(sep.logits, alone):
        torch.testing.assert_close(got, want.logits[0], rtol=1e-4, atol=1e-4)


def test_decode_with_mixed_cache_matches_full_recompute(model):
    """Each decode step reads the K/V its predecessors wrote, whichever chain wrote them."""
    L = model.args.n_layer
    c = model.new_cache(64)
    model.step([(PROMPT, c)], Policy.backbone())
    exits = [-1, 1, L - 1, 0, 2]
    logits = [model.step([([t], c)], Policy(forced=e)).logits[0][0] for t, e in zip([3, 4, 5, 6, 7], exits)]
    # the same positions recomputed from scratch, step by step, must give the same numbers
    c2 = model.new_cache(64)
    model.step([(PROMPT, c2)], Policy.backbone())
    for t, e, want in zip([3, 4, 5, 6, 7], exits, logits):
        torch.testing.assert_close(model.step([([t], c2)], Policy(forced=e)).logits[0][0], want, rtol=0, atol=0)
    # and layer l of a river-exited position holds river K/V: different from the backbone's
    c3 = model.new_cache(64)
    model.step([(PROMPT, c3)], Policy.backbone())
    model.step([([3], c3)], Policy.backbone())
    p = len(PROMPT)
    assert torch.equal(c.k[0, :p], c3.k[0, :p])
    assert not torch.equal(c.k[L - 1, p], c3.k[L - 1, p])


def test_bad_policies_are_clear_errors(model, river_path, tmp_path):
    L = model.args.n_layer
    with pytest.raises(RiverError, match="NaN"):
        run(model, Policy(thresholds=[float("nan")] * L))
    with pytest.raises(RiverError, match=f"{L} numbers"):
        run(model, Policy(thresholds=[0.5] * (L + 1)))
    with pytest.raises(RiverError, match="out of range"):
        run(model, Policy(forced=L))
    with pytest.raises(RiverError, match="min exit layer"):
        run(model, Policy(min_exit_layer=L))
    with pytest.raises(RiverError, match="token id"):
        run(model, Policy.backbone(), tokens=[model.args.n_vocab])
    base = RiverModel(plain(river_path, tmp_path / "base.gguf", "backbone"))
    with pytest.raises(RiverError, match="no river tensors"):
        run(base, Policy.all_river())
    assert torch.equal(run(base, Policy.backbone()), run(model, Policy.backbone()))


def test_unsupported_or_foreign_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(RiverError, match="junk.gguf"):
        RiverModel(junk)
    with pytest.raises(RiverError, match="no such file"):
        RiverModel(tmp_path / "missing.gguf")


# -- against llama.cpp (stock path: plain GGUFs) --------------------------------------------------------

def llama_cpp_logits(path, tokens, n_new):
    llama_cpp = pytest.importorskip("llama_cpp")
    # swa_full: a sliding-window cache otherwise reuses the cells of tokens out of the window, which reorders the
    # sums of later rows (noise that flips Q8 roundings); RiverLlama loads with it too
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, logits_all=True, swa_full=True, verbose=False)
    llm.eval(tokens)
    out = []
    for _ in range(n_new):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    return out, np.array(llm.scores[: llm.n_tokens]), unrounded_weights(llm)


@pytest.mark.parametrize("which", ["backbone", "river"])
def test_reference_matches_llama_cpp(river_path, tmp_path, which):
    """Greedy tokens identical and logits within 1e-3 of the largest one, for the backbone (F16) and
    the river (Q4_0: ggml rounds activations to Q8_0, which the reference emulates). A Q8 rounding step
    can flip on summation-order noise, so a rare position may differ more: 1e-2 at most."""
    path = plain(river_path, tmp_path / f"{which}.gguf", which)
    toks, scores, unrounded = llama_cpp_logits(path, PROMPT, 12)
    ref = RiverModel(path, unrounded=unrounded)   # ggml's AMX F16 kernels do not round activations
    c = ref.new_cache(64)
    got = [ref.step([(PROMPT, c)], Policy.backbone()).logits[0]]
    for t in toks[:-1]:
        got.append(ref.step([([t], c)], Policy.backbone()).logits[0])
    got = torch.cat(got).numpy()
    assert got.argmax(-1)[len(PROMPT) - 1:].tolist() == toks
    scale = np.abs(scores).max(-1, keepdims=True)
    err = (np.abs(got - scores[: len(got)]) / scale[: len(got)]).max(-1)
    assert np.quantile(err, 0.9) < 1e-3 and err.max() < 1e-2, err
