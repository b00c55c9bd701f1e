"""Exact mode's drafters (river_edge/runtime/drafters.py): prompt lookup, the river with n-gram proposals, a separate
draft model. Every drafter goes through the same loop, so each must give the backbone's greedy tokens, and
each must actually draft (a drafter that never proposes would pass the first check trivially)."""
from __future__ import annotations

import numpy as np
import pytest

from river_edge.runtime.costs import CostModel
from river_edge.runtime.drafters import ModelDrafter, Ngram, NgramCache
from river_edge.format import RiverError
from river_edge.gguf_tools.convert import plain
from river_edge.runtime.llama import RiverLlama

# repetitive prompts: prompt lookup has something to find
PROMPTS = [[1, 5, 9, 200, 5, 9, 200, 5, 9], [1, 17, 3, 3, 3, 3], [1, 42, 43, 44, 45, 46, 42, 43]]
N = 64


def _llm(path, mode, **kw):
    return RiverLlama(str(path), mode=mode, **{"n_ctx": 256, "seed": 0, **kw})


def _gen(llm, prompt, n=N):
    return [t for _, t in zip(range(n), llm.generate(prompt, temp=0.0))]


@pytest.fixture(params=["tiny_llama", "tiny_qwen2"])
def model(request):
    return request.getfixturevalue(request.param)


def _lookup(cls, tokens, **kw):
    g = cls(**kw)
    g.begin(tokens)   # a generate() call's prompt
    return g


def test_ngram_index_finds_the_latest_longest_match():
    g = _lookup(Ngram, [1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    assert g.propose(3) == [7, 8, 4]        # "2 3" last continued by 7 (the 3-gram "4 2 3" is new)
    g.accept([7])
    assert g.propose(2) == [8, 4]            # "2 3 7" seen once
    assert g.offer(2).cap == 2 and g.offer(2).free
    assert _lookup(Ngram, [5, 6]).propose(4) == []    # nothing repeats
    assert _lookup(Ngram, [4, 4]).propose(3) == [4]   # a continuation stops at the context's end


def test_ngram_cache_chains_the_most_frequent_continuation():
    g = _lookup(NgramCache, [7, 1, 2, 7, 1, 3, 7, 1, 2, 9], n_max=2)
    # after "9" nothing is known; after "... 7 1" the cache says 2 (twice) over 3 (once)
    assert g.propose(3) == []
    g.extend([7, 1])
    # "1 2" went on to 7 and to 9: a tie, broken towards the latest (9); then "2 9" -> 7 (seen since), "9 7" -> 1
    assert g.propose(4) == [2, 9, 7, 1]
    assert len(g.propose(6)) == 6


@pytest.mark.parametrize("drafter", ["ngram", "ngram-cache", "river+ngram"])
def test_ngram_drafters_are_exact_and_draft(model, drafter):
    ref, ex = _llm(model, "backbone"), _llm(model, "exact", drafter=drafter)
    ex.decoding.draft_k = 4     # the cost model's choice depends on this machine's timings; proposals are capped by it
    for p in PROMPTS:
        assert _gen(ex, p) == _gen(ref, p)
    by = ex.stats()["by_drafter"]
    src = "ngram-cache" if drafter == "ngram-cache" else "ngram"
    assert by[src]["drafted"] > 0 and by[src]["accepted"] > 0
    if drafter == "river+ngram":   # where the context has no match the river drafts
        _gen(ex, [1, 2, 77], n=8)
        assert ex.stats()["by_drafter"]["river"]["drafted"] > 0


def test_draft_model_is_exact_and_its_own_backbone_is_always_accepted(model, tmp_path):
    ref = _llm(model, "backbone")
    same = plain(model, tmp_path / "backbone.gguf", "backbone")      # the backbone itself as the drafter
    other = plain(model, tmp_path / "river.gguf", "river")           # a different model, same vocabulary
    for path, all_kept in ((same, True), (other, False)):
        ex = _llm(model, "exact", drafter=str(path))
        ex.decoding.draft_k = 3
        for p in PROMPTS:
            assert _gen(ex, p) == _gen(ref, p)
        s = ex.stats()["by_drafter"][f"model:{path}"]
        assert s["drafted"] > 0
        assert (s["accepted"] == s["drafted"]) == all_kept


@pytest.mark.parametrize("drafter", ["ngram", "ngram-cache", "draft"])
def test_exact_mode_on_a_plain_gguf(tiny_qwen2_base, drafter):
    """Any GGUF the runtime loads runs exact mode with a drafter that needs no river: the text is llama_cpp.Llama's on
    the same file, token for token, and it drafts."""
    import llama_cpp

    stock = llama_cpp.Llama(str(tiny_qwen2_base), n_ctx=256, seed=0, verbose=False)
    ex = _llm(tiny_qwen2_base, "exact")
    ex.drafter = str(tiny_qwen2_base) if drafter == "draft" else drafter   # its own weights as a draft model
    ex.decoding.draft_k = 3
    assert not ex.has_river and ex.drafter in (drafter, str(tiny_qwen2_base))
    for p in ([1, 5, 9, 200, 5, 9, 200, 5, 9], [1, 17], [1, 42, 43, 44, 45, 42, 43, 44]):
        want = [t for _, t in zip(range(40), stock.generate(p, temp=0.0))]
        assert [t for _, t in zip(range(40), ex.generate(p, temp=0.0))] == want
    assert ex.stats()["drafted"] > 0
    with pytest.raises(RiverError, match="needs a river"):
        ex.drafter = "river+ngram"


def test_drafter_errors(model, tmp_path):
    from river_edge.gguf_tools.tiny import write_tiny_model

    ex = _llm(model, "exact")
    with pytest.raises(RiverError, match="unknown drafter"):
        ex.drafter = "medusa"
    with pytest.raises(RiverError, match="no such file"):
        ex.drafter = str(tmp_path / "nope.gguf")
    other = write_tiny_model(tmp_path / "other.gguf", vocab=300)
    with pytest.raises(RiverError, match="vocabulary"):
        ex.drafter = str(other)
    assert ex.drafter == "river"


def test_free_drafts_choose_longer_k():
    """The same batch-cost curve: a drafter that costs nothing is worth a longer draft than the river."""
    cm = CostModel(draft_s=0.3, verify_s=[0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8])
    assert cm.best_k(0.7, 8, "ngram") > cm.best_k(0.7, 8, "river") >= 1
    cm.observe(0, 0.05, "model:x")
    assert 0.05 < cm.step_s("model:x") < 0.3      # a median with the starting guess, not the guess
    assert np.isclose(cm.step_s("river"), 0.3)


def test_a_drafter_of_ones_own_drafts_through_the_one_loop(tiny_llama):
    """The Drafter protocol (drafters.py: begin, offer, draft, accept), here through ModelDrafter (a model drafting a
    token at a time: prepare, step, done): an object of one's own drafts in exact mode, charged and counted under its
    own name, and the text is the backbone's whatever it proposes (here always token 5)."""
    class Constant(ModelDrafter):
        source = "constant"

        def __init__(self, n_vocab):
            self.row, self.steps, self.cycles = np.zeros(n_vocab, np.float32), 0, 0
            self.row[5] = 1.0

        def prepare(self, ctx):
            self.cycles += 1

        def step(self, tok, pos):
            self.steps += 1
            return self.row

        def done(self):
            pass
    ex = _llm(tiny_llama, "exact")
    ex.drafter = d = Constant(ex.n_vocab())
    ex.decoding.draft_k = 3
    assert _gen(ex, PROMPTS[0], 40) == _gen(_llm(tiny_llama, "backbone"), PROMPTS[0], 40)
    by = ex.stats()["by_drafter"]
    assert ex.drafter == "constant" and set(by) == {"constant"} and by["constant"]["drafted"] == d.steps > 0
    assert d.cycles == by["constant"]["cycles"]
    with pytest.raises(RiverError, match="unknown drafter"):
        ex.drafter = object()


def test_no_probing_where_no_acceptance_could_pay(tiny_llama):
    """Where a draft costs more than any batch could save (drafts always accepted would still lose), exact mode
    decodes as its backbone and does not try a draft every 16 tokens (the shipped 1.5B weights on an AMD Zen 4
    host lost 6% to such probes); where drafting could pay, the probes go on."""
    verify = [0] + [1e-4] * 9          # flat: real one-token timings observed later cannot undercut it
    for draft_s, probes in ((10.0, False), (5e-5, True)):
        ex = _llm(tiny_llama, "exact")
        cm = CostModel(draft_s=draft_s, verify_s=list(verify), ties=[0.0] * 10)
        ex.decoding.cost_model = cm
        ex.decoding.acceptance_counts["river"] = [0.0, 50.0]        # a river that was never right: k = 0 at its acceptance
        assert _gen(ex, PROMPTS[0], 60) == _gen(_llm(tiny_llama, "backbone"), PROMPTS[0], 60)
        assert (ex.stats()["drafted"] > 0) == probes


def test_verification_batches_that_change_the_arithmetic_are_not_chosen():
    """A batch size whose rows depart from one-token decoding by more than rounding (ggml's batched k-quant
    kernels on CPU) is never the cost model's choice, however cheap; one-token batches always are."""
    verify = [0, 1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4]
    ties = [0.0, 0.0, 0.01, 0.01, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6]
    cm = CostModel(draft_s=0.05, verify_s=list(verify), ties=ties)
    assert cm.best_k(0.95, 8) == 2                   # batches of 4+ would pay, but are not exact arithmetic
    assert CostModel(draft_s=0.05, verify_s=list(verify)).best_k(0.95, 8) > 2
    assert CostModel(draft_s=0.05, verify_s=list(verify), ties=[0.0, 0.0] + [2.0] * 8).best_k(0.95, 8) == 0


def test_the_rounding_limit_is_on_the_departure_not_its_tie_headroom():
    """ties hold 4x the measured departure; a batch departing by 0.03 logits (F16 over RPC, here) is usable, one
    departing by 0.2 is not: the limit is ROUNDING on the departure itself (docs/design.md §4)."""
    from river_edge.runtime.costs import ROUNDING

    verify = [0, 1.0, 1.05, 1.1, 1.15]
    cm = CostModel(draft_s=0.05, verify_s=verify, ties=[0.0, 0.0, 4 * 0.03, 4 * ROUNDING, 4 * 0.2])
    assert [cm.usable(n) for n in (1, 2, 3, 4)] == [True, True, True, False]
    assert cm.as_dict()["batch_deviation"][1] == pytest.approx(0.03)


def test_drafting_stops_after_an_unsure_draft(tiny_llama):
    """A cycle stops drafting after a draft whose top-1 probability is below draft_stop (it is still verified):
    above every probability each cycle drafts one token; with no stop the cost model's k; both exact."""
    from river_edge.runtime.sampling import top1_prob

    row = np.array([2.0, 1.0, -3.0, 0.5], dtype=np.float32)
    assert top1_prob(row) == pytest.approx(np.exp(2.0) / np.exp(row.astype(np.float64)).sum(), rel=1e-6)
    want = _gen(_llm(tiny_llama, "backbone"), PROMPTS[0], 60)
    lens = {}
    for stop in (1.01, None):
        ex = _llm(tiny_llama, "exact")
        cm = CostModel(draft_s=5e-5, verify_s=[0] + [1e-4] * 9, ties=[0.0] * 10)   # drafting pays: k = 8
        ex.decoding.cost_model = cm
        ex.decoding.acceptance_counts["river"] = [50.0, 0.0]
        ex.decoding.draft_stop, ex.decoding.draft_log = stop, []
        assert _gen(ex, PROMPTS[0], 60) == want
        lens[stop] = [len(conf) for conf, _, _ in ex.decoding.draft_log]
    assert {n for n in lens[1.01] if n} == {1}          # cycles at k = 0 (the acceptance fell) log no draft
    assert max(lens[None]) > 1


def test_cost_models_are_per_loading_and_a_probe_cut_by_the_context_is_not_kept(tiny_llama):
    """The cost model (and its tie bounds, which exactness relies on) is keyed by everything that changes a
    batch's arithmetic or cost: flash attention here. A first request at the end of the context measures fewer
    batch sizes: that curve serves it alone, and a later request measures the whole one."""
    from river_edge.runtime import costs

    a, b = _llm(tiny_llama, "exact", flash_attn=False), _llm(tiny_llama, "exact", flash_attn=True)
    assert a.decoding.key() != b.decoding.key()
    costs._COSTS.clear()
    n_ctx = a.n_ctx()
    a.create_completion([1] + [(i * 7) % 250 + 3 for i in range(n_ctx - 4)], max_tokens=3, temperature=0)
    assert costs.cached(a.decoding.key()) is None          # measured only 3 positions deep: not kept
    a.create_completion("hello world", max_tokens=4, temperature=0)
    cm = costs.cached(a.decoding.key())
    assert cm is not None and len(cm.verify_s) == a.decoding.kmax + 2
    assert costs.cached(b.decoding.key()) is None          # not shared with the flash-attention loading


def test_a_river_llama_is_freed_with_its_last_reference(tiny_llama, tiny_llama_base):
    """No reference cycle (the mode machinery holds its model weakly): the weights and KV cache go when the
    last reference does, without a gc pass, as a stock Llama's do; close() frees a draft model it loaded."""
    import gc
    import weakref

    gc.disable()
    try:
        m = _llm(tiny_llama, "exact")
        m.create_completion("hi", max_tokens=4, temperature=0)
        w = weakref.ref(m)
        del m
        assert w() is None
    finally:
        gc.enable()
    m = _llm(tiny_llama, "exact", drafter=str(tiny_llama_base))
    dm = m.decoding.draft_gguf
    assert dm is not None and dm.llm._stack._exit_callbacks
    m.close()
    assert m.decoding.draft_gguf is None and not dm.llm._stack._exit_callbacks


def test_the_lookups_acceptance_is_judged_on_every_proposal_and_only_there(tiny_llama):
    """The n-gram drafter's running acceptance (what the cost gate drafts by) moves only with evidence: a cycle
    that proposed nothing leaves it as it was (decaying it to the prior made SmolLM2's chat draft again after every
    plain spell, 0.92x the file), and a proposal left undrafted is judged by the token the backbone chose, free, so
    the gate learns a lookup is right (an edit) without drafting first."""
    from river_edge.runtime.exact import Cycle

    spec = _llm(tiny_llama, "exact", drafter="ngram").decoding

    def undrafted(proposed=None, out=7):
        c = Cycle(0, "ngram", 0, [3], out=[out])
        c.proposed = proposed
        spec.count(c)
        return spec.acceptance_of("ngram")

    spec.acceptance_counts["ngram"] = [0.0, 8.0]   # eight rejections: the lookup is wrong here
    low = spec.acceptance_of("ngram")
    assert low < 0.2 and undrafted() == low and [undrafted() for _ in range(30)][-1] == low
    right = [undrafted(proposed=7) for _ in range(30)]
    assert right[0] > low and right[-1] > 0.9 and right == sorted(right)
    wrong = [undrafted(proposed=8) for _ in range(30)]
    assert wrong[-1] < 0.2 and wrong == sorted(wrong, reverse=True)
    assert spec.st.drafted == 0   # judged for the gate, never counted as drafts


def test_a_cycle_modelled_near_break_even_is_not_drafted():
    """The gate drafts only where the modelled rate beats a plain step's by MARGIN (what a cycle costs beyond the
    model): free lookups at a verify(2) of 1.5 steps draft at acceptance 0.65 (1.10x modelled), not at 0.53 (1.02x)."""
    from river_edge.runtime.headclock import MARGIN

    cm = CostModel(draft_s=0.05, verify_s=[0, 1.0, 1.5, 2.0], ties=[0.0] * 4)
    assert cm.rate(1, 0.53, drafter="ngram") / cm.rate(0, 0.53, drafter="ngram") < MARGIN
    assert cm.best_k(0.53, 2, "ngram") == 0
    assert cm.best_k(0.65, 2, "ngram") == 1
