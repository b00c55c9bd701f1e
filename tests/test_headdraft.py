"""Head drafting (river_edge/runtime/headdraft.py, patches/0017-0018): a trimmed LM head drafts, the full head over
the stored head inputs verifies. Bitwise against the stock runtime: the full head's batched rows are one-token rows,
the trimmed head's entries are the full head's, and exact mode with the head drafter writes llama_cpp.Llama's text."""
from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from river_edge.gguf_tools.reader import open_gguf
from river_edge.gguf_tools.tiny import write_tiny_model
from river_edge.runtime import headrank
from river_edge.runtime.llama import RiverLlama

from conftest import ARCHS

PROMPTS = [[1, 5, 9, 200, 5, 9], [1, 17], [1, 42, 43, 44, 45, 46, 42, 43]]
ERR_VALUE, ERR_SIZE = -102, -101


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Rankings go to a sidecar under the cache: a test's own, never the user's."""
    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path / "cache"))


def _llm(path, **kw):
    return RiverLlama(str(path), mode="exact", **{"n_ctx": 256, "seed": 0, **kw})


def _one_token_rows(llm, toks):
    """Each token decoded alone on the stock path (full head): its logits row and its head input."""
    dec = llm.decoder
    dec.remove(0)
    dec.keep_hidden(True)
    rows, hs = [], []
    for i, t in enumerate(toks):
        rows.append(np.array(dec.decode([t], i)[0]))
        hs.append(dec.hidden())
    dec.keep_hidden(False)
    return np.array(rows), np.array(hs)


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0", "q4_1", "q6_k", "f16"])   # q6_k: the Q4_K_M files' head
def test_batched_head_rows_are_one_token_rows(tiny_dir, wtype):
    """llama_head_logits over k stored head inputs gives each row the bits a one-token decode's head gives it, for
    every k (Q8_0, Q4_0, Q4_1 take patch 18's two- and four-column kernels on x86, Q6_K patch 19's)."""
    wide = dict(n_embd=256, n_head=4, n_head_kv=2, n_ff=512) if wtype.endswith("_k") else {}   # K-quant rows: 256
    path = write_tiny_model(tiny_dir / f"head-{wtype}.gguf", "qwen2", wtype=wtype, tie_embeddings=True, seed=7, **wide)
    assert open_gguf(path).get_tensor(0).tensor_type.name == wtype.upper()   # the head: tied to token_embd
    llm = _llm(path)
    want, hs = _one_token_rows(llm, [1, 5, 9, 200, 5, 9, 33, 7, 100, 12, 3])
    for k in (1, 2, 3, 4, 5, 8, 11):
        got = llm.decoder.head_logits(hs[:k])
        assert got.tobytes() == want[:k].tobytes(), f"{wtype}: {k} rows"


@pytest.mark.parametrize("arch", ARCHS)
def test_trimmed_rows_are_the_full_heads_entries(arch, request):
    base = request.getfixturevalue(f"tiny_{arch}_base")
    llm = _llm(base)
    dec = llm.decoder
    full, _ = _one_token_rows(llm, PROMPTS[0])
    ids = np.random.default_rng(0).choice(dec.n_vocab, size=dec.n_vocab // 3, replace=False).astype(np.int32)
    assert dec.set_head_rows(ids) == 0
    trimmed, _ = _one_token_rows(llm, PROMPTS[0])
    assert dec.set_head_rows([]) == 0
    assert trimmed[:, ids].tobytes() == full[:, ids].tobytes()
    rest = np.setdiff1d(np.arange(dec.n_vocab), ids)
    assert np.all(np.isneginf(trimmed[:, rest]))
    again, _ = _one_token_rows(llm, PROMPTS[0])   # the whole head again
    assert again.tobytes() == full.tobytes()


def test_bad_rows_are_refused(tiny_qwen2_base):
    llm = _llm(tiny_qwen2_base)
    dec = llm.decoder
    assert dec.set_head_rows([0, 1, dec.n_vocab]) == ERR_VALUE
    assert dec.set_head_rows([-1]) == ERR_VALUE
    assert dec.set_head_rows([3, 4, 3]) == ERR_VALUE
    assert dec.set_head_rows(np.arange(dec.n_vocab + 1)) == ERR_SIZE
    with pytest.raises(RuntimeError, match="llama_head_logits"):
        dec.head_logits(np.zeros((0, dec.n_embd), dtype=np.float32))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("river", [False, True], ids=["plain", "river"])
def test_head_drafting_writes_the_stock_runtimes_text(arch, river, request):
    """Exact mode with the head drafter, over a plain GGUF and a river GGUF's backbone: llama_cpp.Llama's greedy text,
    with a trimmed head small enough that drafts are rejected too."""
    path = request.getfixturevalue(f"tiny_{arch}" if river else f"tiny_{arch}_base")
    stock = llama_cpp.Llama(str(path), n_ctx=256, seed=0, verbose=False)
    ex = _llm(path, drafter="head")
    ex.decoding.active_drafter.n_rows = ex.decoder.n_vocab // 8
    rng = np.random.default_rng(0)
    ex.decoding.draft_k = lambda: int(rng.integers(1, 9))   # every k, not the timed cost gate's choice
    for p in PROMPTS:
        want = [t for _, t in zip(range(48), stock.generate(p, temp=0.0))]
        assert [t for _, t in zip(range(48), ex.generate(p, temp=0.0))] == want, p
    s = ex.stats()
    assert s["drafted"] > 0 and 0 < s["accepted"] < s["drafted"], s
    assert ex.decoder.n_head_rows() == 0   # the trimmed head is cleared after each call


def test_head_drafting_leaves_sampling_to_the_backbone(tiny_llama_base):
    """The head drafter drafts greedy text only: sampled text is the stock runtime's seed for seed, and says so."""
    stock = llama_cpp.Llama(str(tiny_llama_base), n_ctx=256, seed=5, verbose=False)
    ex = _llm(tiny_llama_base, drafter="head", seed=5)
    want = [t for _, t in zip(range(24), stock.generate(PROMPTS[0], temp=0.7))]
    assert [t for _, t in zip(range(24), ex.generate(PROMPTS[0], temp=0.7))] == want
    assert "sampling" in ex.stats()["spec_off"]


def test_a_head_too_small_to_pay_hands_later_calls_to_the_backbone(tiny_llama_base):
    """Once the clock has measured the whole head under HEAD_SHARE of a plain step, later calls decode on the
    backbone from the start (no trimmed head, no bookkeeping) and say why; the text is the stock runtime's."""
    stock = llama_cpp.Llama(str(tiny_llama_base), n_ctx=256, seed=0, verbose=False)
    ex = _llm(tiny_llama_base, drafter="head")
    want = [t for _, t in zip(range(24), stock.generate(PROMPTS[0], temp=0.0))]
    assert [t for _, t in zip(range(24), ex.generate(PROMPTS[0], temp=0.0))] == want
    clock = ex.decoding.active_drafter.clock
    for what, sec, k in (("step", 0.010, 0), ("step", 0.010, 0), ("draft", 0.009, 0), ("head", 0.0016, 1)):
        for _ in range(9):   # a whole window: the lower medians are these
            clock.observe(what, sec, k)
    assert clock.futile
    drafted = ex.stats()["drafted"]
    assert [t for _, t in zip(range(24), ex.generate(PROMPTS[0], temp=0.0))] == want
    s = ex.stats()
    assert "fifth of a step" in s["spec_off"] and s["drafted"] == drafted, s


def test_the_ranking_is_built_once_per_file_and_a_damaged_one_again(tiny_qwen2_base):
    llm = _llm(tiny_qwen2_base)
    r = headrank.load_or_build(llm)
    assert sorted(r.tolist()) == list(range(llm.decoder.n_vocab))
    side = headrank.sidecar(tiny_qwen2_base)
    stamp = side.stat().st_mtime_ns
    assert np.array_equal(headrank.load_or_build(llm), r) and side.stat().st_mtime_ns == stamp
    side.write_bytes(b"not a numpy file")
    assert np.array_equal(headrank.load_or_build(llm), r)
    assert list(side.parent.glob("*.tmp")) == []


def test_a_river_gguf_carries_its_ranking(tiny_qwen2_base, tmp_path):
    """`river build` stores the ranking in the river GGUF (river.head_ranking): the head drafter reads it there and
    writes no sidecar; a bad one is refused when the river is built."""
    from river_edge.format import RiverError
    from river_edge.gguf_tools.build import build_river

    n = _llm(tiny_qwen2_base).decoder.n_vocab
    perm = np.random.default_rng(0).permutation(n).astype(np.int32)
    out = build_river(tiny_qwen2_base, tmp_path / "r.gguf", ranking=perm)
    assert np.array_equal(headrank.load_or_build(_llm(out)), perm)
    assert not headrank.sidecar(out).exists() and not headrank.sidecar(tiny_qwen2_base).exists()
    with pytest.raises(RiverError, match="must appear once"):
        build_river(tiny_qwen2_base, tmp_path / "bad.gguf", ranking=np.r_[perm[:-1], perm[0]])
    assert not (tmp_path / "bad.gguf").exists()


def test_the_cost_gate_decodes_plainly_where_drafts_cannot_pay():
    """S(k) = E(k, a) t_step / (k t_draft + t_head(k)): drafting only where some k beats a plain step."""
    from river_edge.runtime.headclock import Clock
    c = Clock()
    assert c.best_k(8, 0.9) == 0               # a plain step's cost first
    c.observe("step", 0.010)
    c.observe("step", 0.010)
    assert c.best_k(8, 0.9) == 4               # then one cycle to measure drafts and the head
    c.observe("draft", 0.009)
    c.observe("head", 0.008, 4)
    assert c.best_k(8, 1.0) == 0               # 4 x 9 + 8 ms for at most 4 tokens of 10 ms: no k pays
    c.observe("draft", 0.004)
    c.observe("draft", 0.004)
    assert c.best_k(8, 0.95) > 0
    assert c.best_k(8, 0.3) == 0               # rows that hold a third of the text: plain
    for _ in range(8):
        c.cycle(4, 0.042, 4)                   # the cycles' own wall time per token says it does not pay
    assert c.best_k(8, 0.95) == 0


def test_a_request_whose_text_the_rows_hold_drafts_after_one_they_did_not(tiny_qwen2_base):
    """The gate's acceptance is the rows' coverage of the text, counted on plain steps too, and a new request's own
    text soon outweighs the last one's: a chat the rows missed must not keep an edit they hold from drafting."""
    from river_edge.runtime.headclock import Clock
    from river_edge.runtime.headdraft import TrimmedHead
    dec = _llm(tiny_qwen2_base).decoder
    ranking = np.arange(dec.n_vocab, dtype=np.int32)
    h = TrimmedHead(dec, ranking, 8, sizes=(8,))
    c = Clock()
    for what, sec, k in (("step", 0.010, 0), ("step", 0.010, 0), ("draft", 0.004, 0), ("head", 0.0065, 1),
                         ("head", 0.008, 4)):
        c.observe(what, sec, k)
    h.begin([1, 2])
    h.observe(list(range(100, 164)))           # a chat: none of it in the 8 rows
    assert h.acceptance < 0.1 and c.best_k(8, h.acceptance) == 0
    h.begin([200, 201, 202])                   # an edit: its answer repeats its prompt
    h.observe([200, 201, 202] * 6)
    assert h.acceptance > 0.85 and c.best_k(8, h.acceptance) > 0
    h.observe([250])                           # a miss: counted as one, then held at any size
    assert h.missed(250) is False and h.always[250]


def test_the_cost_gate_sizes_the_trimmed_head_by_measured_coverage():
    """More rows where the verified text needed them (acceptance gained is worth the rows' cost), fewer where every
    size held it; a size set by hand is never changed."""
    from river_edge.runtime.headclock import Clock
    from river_edge.runtime.headdraft import row_sizes
    assert row_sizes(262144) == (8192, 16384, 32768, 65536) and row_sizes(5000) == (4096,)
    c = Clock()
    for what, sec in (("step", 0.010), ("step", 0.010), ("draft", 0.006)):
        c.observe(what, sec)
    for k in (2, 4, 8):   # (the head over one row unmeasured: the plain step is the measured one, not capped)
        c.observe("head", 0.002 + 0.0005 * k, k)
    n_vocab, cur = 262144, 16384   # the step's 4 ms over the draft's: 245,760 rows left out
    assert c.best_rows(cur, n_vocab, {8192: 0.70, 16384: 0.80, 32768: 0.97, 65536: 0.975}, 8) == 32768
    assert c.best_rows(cur, n_vocab, {8192: 0.999, 16384: 0.999, 32768: 0.999, 65536: 0.999}, 8) == 8192
    assert c.best_rows(cur, n_vocab, {8192: 0.80, 16384: 0.801, 32768: 0.802, 65536: 0.803}, 8) == cur  # < 2%


def test_the_trimmed_head_counts_what_each_size_would_have_held(tiny_qwen2_base):
    from river_edge.runtime.headdraft import TrimmedHead
    llm = _llm(tiny_qwen2_base)
    dec = llm.decoder
    ranking = np.arange(dec.n_vocab)[::-1].copy()     # the last id first
    h = TrimmedHead(dec, ranking, 2, sizes=(2, 4))
    assert h.apply([7])                                # the prompt's token 7: held at every size
    h.observe([dec.n_vocab - 1, dec.n_vocab - 3, 7, 0])
    cov = h.coverage()
    assert cov[2] == pytest.approx((0.995 ** 3 + 0.995 + 1.6) / (sum(0.995 ** i for i in range(4)) + 2), rel=1e-9)
    assert cov[4] > cov[2]
    dec.set_head_rows([])


def test_the_cost_gate_drops_a_step_that_rebuilt_the_graph():
    """A plain step right after the trimmed head is cleared rebuilds the graph (many times a step), and a shared
    machine stalls a step now and then: the gate's step cost (the lower median of the last few) must not take them,
    else drafting looks like it pays whatever it costs."""
    from river_edge.runtime.headclock import COST_WINDOW, Clock
    c = Clock()
    c.observe("step", 0.290)                    # the first step: a graph rebuild
    c.observe("step", 0.035)
    assert c.step == pytest.approx(0.035)
    c.observe("step", 0.036)
    c.observe("step", 0.300)                    # another rebuild, later
    c.observe("step", 0.034)
    c.observe("step", 0.070)                    # a stall
    assert c.step == pytest.approx(0.036)
    for _ in range(COST_WINDOW):
        c.observe("step", 0.050)                # the machine got slower: followed
    assert c.step == pytest.approx(0.050)
    c.observe("draft", 0.020)
    c.shift("draft", -0.005)
    assert c.draft == pytest.approx(0.015)
    c.forget("draft")
    assert c.draft is None


def test_the_cost_gate_weighs_drafts_against_a_step_measured_beside_them():
    """The plain steps come before drafting, possibly under another load: one read high (SmolLM2's 14.2 ms for a
    9.4 ms step) made chat drafting look 1.2x where it was 0.8x. The gate caps the plain step by a draft step plus
    the full head over the rows the trimmed head leaves out, both timed while drafting."""
    from river_edge.runtime.headclock import MARGIN, Clock
    c = Clock()
    for what, sec, k in (("step", 0.0142, 0), ("step", 0.0142, 0), ("draft", 0.0080, 0), ("head", 0.0025, 4)):
        c.observe(what, sec, k)
    c.left_out = 1 - 4297 / 49152
    assert c.plain == pytest.approx(0.0142) and c.best_k(8, 0.8) > 0   # the stale step alone: drafting "pays"
    c.observe("head", 0.0025, 1)
    assert c.plain == pytest.approx(0.0080 + 0.0025 * c.left_out)
    assert c.best_k(8, 0.8) == 0 and c.speedup(0.8, c.draft, 8) == (0, MARGIN)
    assert c.best_k(8, 0.999) > 0                       # where nearly every draft stands, it still pays
    c.observe("step", 0.0090)
    c.observe("step", 0.0090)
    assert c.plain == pytest.approx(0.0090)             # a lower measured step wins: the cap only ever lowers it
    c.left_out = 0.0
    assert c.plain == pytest.approx(0.0080)


def test_drafting_stops_where_the_head_is_too_small_a_share_of_a_step():
    """Where the head rows a draft leaves out cost under HEAD_SHARE of a plain step (SmolLM2: 1.6 of 10.8 ms), the
    gain is within the model's error and the gate decodes plainly after its probe, even where every draft stands;
    the same costs with a larger head draft."""
    from river_edge.runtime.headclock import HEAD_SHARE, Clock
    for head_1, drafts in ((0.0016, False), (0.0050, True)):
        c = Clock()
        c.left_out = 1 - 4342 / 49152
        for what, sec, k in (("step", 0.0108, 0), ("step", 0.0108, 0), ("draft", 0.0080, 0), ("head", 0.0031, 4),
                             ("head", head_1, 1)):
            c.observe(what, sec, k)
        assert (head_1 * c.left_out >= HEAD_SHARE * c.plain) == drafts
        assert c.speedup(0.999, c.draft, 8)[0] > 0            # the model alone would draft both
        assert (c.best_k(8, 0.999) > 0) == drafts
