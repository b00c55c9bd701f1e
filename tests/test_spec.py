"""River-Spec decoding modes (river_edge/runtime/spec.py): exactness of the exact mode (greedy token for token,
the KV cache, sampling in distribution), the gated mode's extremes, and the mode interface."""
from __future__ import annotations

import math

import numpy as np
import pytest

from river_edge.format import RiverError
from river_edge.runtime.llama import RiverLlama

from conftest import ARCHS
from river_edge.runtime.sampling import processed_probs

PROMPTS = [[1, 5, 9, 200], [1, 17], [1, 3, 3, 3, 3, 3, 7], [1, 42, 43, 44, 45, 46, 47, 48]]
N = 48


def _llm(path, mode, **kw):
    return RiverLlama(str(path), mode=mode, **{"n_ctx": 256, "seed": 0, **kw})


def _gen(llm, prompt, n=N, **kw):
    kw.setdefault("temp", 0.0)
    return [t for _, t in zip(range(n), llm.generate(prompt, **kw))]


@pytest.fixture(params=[f"tiny_{a}" for a in ARCHS])
def model(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("k", [None, 1, 3, 8])
def test_exact_greedy_equals_backbone_low_level(model, k):
    ref, ex = _llm(model, "backbone"), _llm(model, "exact")
    ex.decoding.draft_k = k
    for p in PROMPTS:
        assert _gen(ex, p) == _gen(ref, p)
    s = ex.stats()
    assert s["mode"] == "exact" and s["tokens"] == N * len(PROMPTS) and s["spec_off"] is None
    if k:
        assert s["drafted"] > 0 and 0 <= s["acceptance_rate"] <= 1 and s["mean_draft_len"] > 0


@pytest.mark.parametrize("drafter", ["river", "ngram", "river+ngram"])
def test_exact_and_backbone_write_the_stock_runtimes_text(model, drafter):
    """What a user compares with: llama_cpp.Llama itself on the same file (the stock API runs a river GGUF's backbone),
    its batched prompt and one-token steps. Backbone mode with default settings and exact mode with each drafter write
    its greedy text token for token (the completion, chat and stream paths go through the same generate())."""
    import llama_cpp

    stock = llama_cpp.Llama(str(model), n_ctx=256, seed=0, verbose=False)
    bb, ex = _llm(model, "backbone"), _llm(model, "exact", drafter=drafter)
    ex.decoding.draft_k = 4
    for p in PROMPTS + [[1, 5, 9, 200, 5, 9, 200, 5, 9]]:
        want = _gen(stock, p)
        assert _gen(bb, p) == want and _gen(ex, p) == want, p
    assert ex.stats()["drafted"] > 0


def test_exact_equals_backbone_completion_chat_stream(model):
    ref, ex = _llm(model, "backbone"), _llm(model, "exact")
    ex.decoding.draft_k = 3
    for text in ["hello world", "a b c d", "the"]:
        a = ref.create_completion(text, max_tokens=N, temperature=0)
        b = ex.create_completion(text, max_tokens=N, temperature=0)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"] == b["usage"]
        sa = "".join(c["choices"][0]["text"] for c in ref.create_completion(text, max_tokens=N, temperature=0, stream=True))
        sb = "".join(c["choices"][0]["text"] for c in ex.create_completion(text, max_tokens=N, temperature=0, stream=True))
        assert sa == sb  # (llama-cpp-python streams multi-byte junk of random tiny models differently)
    msgs = [{"role": "user", "content": "say something"}]
    ca = ref.create_chat_completion(msgs, max_tokens=N, temperature=0)
    cb = ex.create_chat_completion(msgs, max_tokens=N, temperature=0)
    assert ca["choices"][0]["message"] == cb["choices"][0]["message"]
    sa, sb = ("".join(c["choices"][0]["delta"].get("content") or ""
                      for c in m.create_chat_completion(msgs, max_tokens=N, temperature=0, stream=True))
              for m in (ref, ex))
    assert sa == sb


def _last_logits(llm):
    return llm.decoder.last_logits()


def test_exact_leaves_the_backbone_cache(model):
    """After exact decoding the cache holds backbone K/V only: continuing on the backbone gives the
    logits a backbone-only run gives, up to what batching alone changes (ggml's batched matmuls round
    differently from one-token ones: measured here as a one-batch backbone prefill of the same text),
    and far from what river-written cells give."""
    p = PROMPTS[0]
    ref = _llm(model, "backbone")
    seq = p + _gen(ref, p)

    def cont(mode, fixed_k=None, prefill=False):
        llm = _llm(model, mode)
        llm.decoding.draft_k = fixed_k
        if prefill:
            llm.eval(seq[:-1])
        else:
            assert p + _gen(llm, p) == seq or mode == "fast"
            assert list(llm.input_ids[: len(seq) - 1]) == seq[:-1] or mode == "fast"
            llm.n_tokens = len(p) - 1 if mode == "fast" else len(seq) - 1
            if mode == "fast":
                llm.decoder.force_exit(-1)
                llm.eval(seq[len(p) - 1:-1])   # the river writes the generated part
        # continue on the backbone over whatever the cache holds (the raw C API: the mode setter would
        # rightly drop river-written cells)
        llm.decoder.force_exit(llm.n_layer - 1)
        llm.n_tokens = len(seq) - 1
        llm.eval([seq[-1], 7, 11])
        return _last_logits(llm)

    a = cont("backbone")
    exact = np.abs(cont("exact", 4) - a).max()
    batching = np.abs(cont("backbone", prefill=True) - a).max()
    river = np.abs(cont("fast") - a).max()
    assert exact <= max(2 * batching, 1e-6), (exact, batching)
    assert exact < 0.05 * river, (exact, river)


def _fast_after_backbone_prefill(fast, p, n=N, **kw):
    """The gated mode's schedule with the river always: the whole prompt prefilled by the backbone, whose
    logits give the first token, then all-river steps (one sampler throughout). Forced exits through the
    raw C API: the mode setters would rightly drop the cache."""
    kw.setdefault("temp", 0.0)
    fast.reset()
    fast.decoder.force_exit(fast.n_layer - 1)
    out = []
    for t in fast.generate(p, **kw):
        out.append(t)
        if len(out) == n:
            break
        fast.decoder.force_exit(-1)
    return out


def test_gated_extremes(model):
    ref, fast = _llm(model, "backbone"), _llm(model, "fast")
    g0, ginf = _llm(model, "gated", gate=0.0), _llm(model, "gated", gate=math.inf)
    for p in PROMPTS[:3]:
        assert _gen(g0, p) == _gen(ref, p)
        # no reused prefix: a cell written in a batch of 3 differs in the last bits from one written alone
        ginf.reset()
        assert _gen(ginf, p) == _fast_after_backbone_prefill(fast, p)
    assert g0.stats()["fallback_rate"] == 1.0 and ginf.stats()["fallback_rate"] == 0.0
    # sampling: the gate picks whose logits llama.cpp's own sampler sees, seed for seed
    kw = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    for seed in range(3):
        for a, b in ((g0, ref), (ginf, fast)):
            a.set_seed(seed), b.set_seed(seed)
            a.reset(), b.reset()
            want = _gen(b, PROMPTS[0], n=16, **kw) if b is ref else _fast_after_backbone_prefill(b, PROMPTS[0], n=16, **kw)
            assert _gen(a, PROMPTS[0], n=16, **kw) == want


def test_modes_and_errors(model, tiny_llama_base):
    with pytest.raises(RiverError):
        _llm(model, "turbo")
    llm = _llm(model, "exact")
    with pytest.raises(RiverError):
        llm.mode = "nope"
    for m, e in (("fast", -1), ("river", None), ("backbone", llm.n_layer - 1), ("exact", llm.n_layer - 1)):
        llm.mode = m
        assert llm.mode == m and llm.forced_exit == e
        assert llm.river_enabled == (m != "backbone")   # backbone: the river off, the stock graph
    assert RiverLlama(str(model), n_ctx=64).mode == "river"
    for m in ("gated", "river", "fast"):
        with pytest.raises(RiverError, match="needs a river"):
            RiverLlama(str(tiny_llama_base), mode=m, n_ctx=64)
    with pytest.raises(RiverError, match="needs a river"):
        RiverLlama(str(tiny_llama_base), mode="exact", drafter="river", n_ctx=64)
    assert RiverLlama(str(tiny_llama_base), n_ctx=64, mode="backbone").mode == "backbone"
    assert RiverLlama(str(tiny_llama_base), n_ctx=64, mode="exact").drafter == "ngram"   # a plain GGUF's default


def test_exact_refuses_to_speculate_unsupported_settings(model):
    from llama_cpp import LlamaGrammar

    ref, ex = _llm(model, "backbone"), _llm(model, "exact")
    kw = lambda: dict(temp=0.0, grammar=LlamaGrammar.from_string('root ::= [a-z ]+', verbose=False))  # noqa: E731
    assert _gen(ex, PROMPTS[0], n=16, **kw()) == _gen(ref, PROMPTS[0], n=16, **kw())
    assert ex.stats()["spec_off"] == "grammar"


LAST_N = 16   # the penalty window the exact-vs-backbone tests run with
PENALTIES = [dict(repeat_penalty=1.3), dict(repeat_penalty=1.1, frequency_penalty=0.4, presence_penalty=0.3),
             dict(repeat_penalty=0.8, presence_penalty=-0.5)]


def _assert_rounding_tie(model, prompt, want, got, pen):
    """Exact mode is the backbone's text up to ties below rounding: where an F16 backbone's batch rows depart
    from one-token decoding (ggml's CPU kernels on non-AMX hosts), K/V cells written by a verification batch carry
    that rounding into later positions. So the first token that differs must sit on a top-2 margin of the
    backbone's own (penalised) logits below 1e-3, with exact's token the runner-up."""
    from river_edge.runtime.sampling import Transform

    i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    m = _llm(model, "backbone", logits_all=True)
    for t in [*prompt, *want[:i]]:
        m.eval([t])
    row = Transform(pen, LAST_N)(m.scores[m.n_tokens - 1], None, want[:i])
    top = np.argsort(row)[-2:]
    assert set(top) == {want[i], got[i]} and row[top[1]] - row[top[0]] < 1e-3, (i, row[top[1]] - row[top[0]])


@pytest.mark.parametrize("pen", PENALTIES)
def test_exact_greedy_with_penalties_is_speculated_and_exact(model, pen):
    """Chat front-ends send repeat_penalty 1.1: exact mode applies the penalties row by row inside the
    speculative loop (it used to fall back to plain backbone decoding)."""
    ref, ex = _llm(model, "backbone", last_n_tokens_size=LAST_N), _llm(model, "exact", last_n_tokens_size=LAST_N)
    ex.decoding.draft_k = 3       # drafts to verify whatever the tiny model's costs say
    changed = 0
    for p in PROMPTS[:3]:
        want = _gen(ref, p, n=96, **pen)
        got = _gen(ex, p, n=96, **pen)
        if got != want:
            _assert_rounding_tie(model, p, want, got, pen)
        changed += want != _gen(ref, p, n=96)
    assert changed   # the penalties change the text somewhere: the test can fail
    s = ex.stats()
    assert s["spec_off"] is None and s["drafted"] > 0 and s["accepted"] > 0


def test_a_negative_penalty_window_is_off_as_in_llama_cpp(model):
    """llama.cpp takes last_n_tokens_size < 0 as 0: no penalties. Exact mode did penalise every generated token."""
    ref, ex = _llm(model, "backbone", last_n_tokens_size=-1), _llm(model, "exact", last_n_tokens_size=-1)
    ex.decoding.draft_k = 3
    pen = dict(repeat_penalty=1.5, frequency_penalty=0.5)
    for p in PROMPTS[:2]:
        want = _gen(ref, p, **pen)
        assert want == _gen(ref, p)   # off in the backbone: the test can fail
        assert _gen(ex, p, **pen) == want


def test_a_stopped_exact_run_leaves_what_backbone_mode_leaves(model):
    """Stopped mid-cycle (max_tokens, a stopping criterion), exact mode's context holds the tokens before the last
    one emitted, as backbone decoding's does, not accepted drafts nobody saw: same n_tokens, same finish_reason."""
    from llama_cpp import StoppingCriteriaList

    ref, ex = _llm(model, "backbone"), _llm(model, "exact")
    ex.decoding.draft_k = 8
    for n in (2, 3, 5):
        for stop in (None, StoppingCriteriaList([lambda ids, logits, n=n: len(ids) >= 2 + 2 * n])):
            a = ref.create_completion("hello world", max_tokens=2 * n if stop else n, temperature=0,
                                      stopping_criteria=stop)
            b = ex.create_completion("hello world", max_tokens=2 * n if stop else n, temperature=0,
                                     stopping_criteria=stop)
            assert (b["choices"][0]["text"], b["choices"][0]["finish_reason"], ex.n_tokens) == \
                (a["choices"][0]["text"], a["choices"][0]["finish_reason"], ref.n_tokens), (n, stop)
    assert ex.stats()["drafted"] > 0


def test_exact_with_logit_bias_is_exact(model):
    ref, ex = _llm(model, "backbone"), _llm(model, "exact")
    ex.decoding.draft_k = 3       # drafts to verify whatever the tiny model's costs say
    bias = {"100": 4.0, "101": -100.0, "65": 2.5}
    for text in ("the cat", "hello world"):
        a = ref.create_completion(text, max_tokens=32, temperature=0, logit_bias=bias)
        b = ex.create_completion(text, max_tokens=32, temperature=0, logit_bias=bias)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert ex.stats()["spec_off"] is None and ex.stats()["drafted"] > 0


def _chi2_quantile(df: int, q: float = 0.999) -> float:
    z = {0.999: 3.0902, 0.99: 2.3263}[q]   # Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("k,sampler,pen", [(1, dict(temp=1.0, top_k=6, top_p=1.0, min_p=0.0), {}),
                                           (3, dict(temp=0.7, top_k=12, top_p=0.9, min_p=0.05), {}),
                                           (2, dict(temp=1.0, top_k=8, top_p=1.0, min_p=0.0),
                                            dict(repeat_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.5))])
def test_exact_sampling_distribution(tiny_qwen2, k, sampler, pen):
    """First two sampled tokens over many seeds follow the backbone's exact joint distribution (chi-square,
    alpha 0.001; deterministic given the seeds). With penalties the second token's distribution is the
    penalised one (the first token in the window); the greedy tests pin the penalties to llama.cpp's."""
    from river_edge.runtime.sampling import Transform

    ref, ex = _llm(tiny_qwen2, "backbone"), _llm(tiny_qwen2, "exact")
    ex.decoding.draft_k = k
    p = PROMPTS[3]
    tf = Transform(pen, 64)

    def dist(prefix):
        ref.reset()
        ref.eval(prefix)
        return processed_probs(tf(_last_logits(ref), prefix, prefix[len(p):]), **sampler)

    p1 = dist(p)
    joint = {}
    for t1 in np.nonzero(p1)[0]:
        p2 = dist(p + [int(t1)])
        for t2 in np.nonzero(p2)[0]:
            joint[(int(t1), int(t2))] = p1[t1] * p2[t2]
    n_runs = 3000
    counts: dict = {}
    for seed in range(n_runs):
        ex.set_seed(seed)
        pair = tuple(_gen(ex, p, n=2, **sampler, **pen))
        assert pair in joint, f"sampled {pair}, impossible under the backbone's sampler"
        counts[pair] = counts.get(pair, 0) + 1
    s = ex.stats()
    # both paths of the accept step ran: drafts kept, and drafts rejected with a residual draw
    assert 0 < s["accepted"] < s["drafted"] and s["rejected_cycles"] > 0
    # cells with expected count < 5 pooled into one
    exp = {c: pr * n_runs for c, pr in joint.items()}
    big = [c for c in exp if exp[c] >= 5]
    obs = [counts.get(c, 0) for c in big]
    e = [exp[c] for c in big]
    rest_e = n_runs - sum(e)
    if rest_e >= 5:
        obs.append(n_runs - sum(obs))
        e.append(rest_e)
    chi2 = sum((o - x) ** 2 / x for o, x in zip(obs, e))
    df = len(e) - 1
    assert df >= 3
    assert chi2 < _chi2_quantile(df), (chi2, df)
    tv = 0.5 * sum(abs(counts.get(c, 0) / n_runs - pr) for c, pr in joint.items())
    assert tv < 0.1


def test_position_keyed_gumbel_samples_the_target_distribution():
    """The sampling step: argmax of log p + the noise of (seed, position) is an exact draw from p over seeds; drafts
    chosen from q on the same noise agree with it at least as often as their overlap suggests (the coupling); and
    the noise of a position is the same whatever was drawn before (nothing depends on the draft length)."""
    from river_edge.runtime.sampling import gumbel, scores

    rng = np.random.default_rng(1)
    V, n = 6, 30_000
    p, q = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V) * 0.5)
    counts, agree = np.zeros(V), 0
    for seed in range(n):
        t = int(scores(p, seed, 7).argmax())
        counts[t] += 1
        agree += t == int(scores(q, seed, 7).argmax())
    chi2 = float(((counts - p * n) ** 2 / (p * n)).sum())
    assert chi2 < _chi2_quantile(V - 1), chi2
    overlap = np.minimum(p, q).sum()
    assert agree / n > overlap / (1 + (1 - overlap)) - 0.02, (agree / n, overlap)   # the Gumbel coupling's bound
    ids = np.arange(V)
    assert np.array_equal(gumbel(3, 9, ids), gumbel(3, 9, ids)) and not np.array_equal(gumbel(3, 9, ids), gumbel(3, 10, ids))
    assert np.array_equal(gumbel(3, 9, ids)[[4, 1]], gumbel(3, 9, np.array([4, 1])))   # per id, not per draw
    assert np.isneginf(scores(np.array([0.5, 0.0, 0.5]), 1, 1)[1])                      # outside the support: never


def test_seeded_exact_sampling_does_not_depend_on_the_draft_lengths(tiny_qwen2):
    """A seed gives one text in exact mode whatever k the cost model picks (k comes from timed costs, so it differs
    between runs and processes): k = 0, 1, 3, random per cycle, each the same text."""
    ex = _llm(tiny_qwen2, "exact")
    r = np.random.default_rng(0)
    texts = []
    for k in (0, 1, 3, lambda: int(r.integers(0, 6))):
        ex.decoding.draft_k = k
        texts.append(ex.create_completion("hello world", max_tokens=40, temperature=0.9, top_k=20, seed=7)
                     ["choices"][0]["text"])
    assert len(set(texts)) == 1 and texts[0]
    assert ex.stats()["drafted"] > 0 and ex.stats()["rejected_cycles"] > 0   # drafts kept and drafts overruled


@pytest.mark.slow
def test_exact_512_tokens_smollm2():
    from river_edge.defaults import default_river

    path = default_river()
    ref = RiverLlama(str(path), mode="backbone", n_ctx=1024, seed=0)
    ex = RiverLlama(str(path), mode="exact", n_ctx=1024, seed=0)
    p = ref.tokenize(b"Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                     b"clips in May. How many clips did Natalia sell altogether in April and May?\nAnswer:")
    # k drawn at random per cycle: this text has a near-tie at token 290 (backbone logits 26.6130 vs 26.6105)
    # that a verification batch's rounding used to flip; near-ties are now decoded alone
    rng = np.random.default_rng(0)
    ex.decoding.draft_k = lambda: int(rng.integers(0, 9))
    a = _gen(ref, p, n=512)
    b = _gen(ex, p, n=512)
    assert a == b
    assert ex.stats()["acceptance_rate"] > 0.5


def test_gate_fit_written_and_read(tiny_llama, tmp_path):
    from river_edge.calibration.gate import fit_gate, gate_metrics, gate_report
    from river_edge.calibration.record import record
    from river_edge.calibration.target import Settings, Target
    from river_edge.gguf_tools.build import set_river_keys
    from river_edge.reference import RiverModel

    prompts = [[5, 77, 120, 3, 64], [9, 8, 7, 6, 5, 4, 3], [100, 101, 102], [40, 41, 42, 43, 44, 45]]
    model, st = RiverModel(tiny_llama, emulate=False), Settings(n_prompts=4, decode_tokens=8, online_tokens=8)
    s = gate_report(model, record(model, prompts[:2], st)[1], record(model, prompts[2:], st)[1], Target("kl", 0.01), st)
    assert s["fit"]["kl"] <= 0.01 and 0 <= s["fit"]["fallback_rate"] <= 1
    # random fallback at the gate's rate costs (1 - rate) x the all-river KL
    t = s["test"]
    assert t["random"]["kl"] == pytest.approx((1 - t["fallback_rate"]) * s["test_all_river"]["kl"])
    dst = tmp_path / "gated.gguf"
    set_river_keys(tiny_llama, dst, gate_entropy=s["gate_entropy"])
    llm = RiverLlama(str(dst), mode="gated", n_ctx=64)
    assert abs(llm.gate - s["gate_entropy"]) < 1e-5
    rec = {"kl": np.array([0.0, 0.1, 0.2, 0.4]), "agree": np.array([1.0, 1, 0, 0]),
           "entropy": np.array([0.1, 0.5, 1.0, 2.0]), "margin": np.array([0.9, 0.5, 0.2, 0.1])}
    assert fit_gate(rec, Target("kl", 0.1)) == 2.0          # mean KL 0.3 / 4
    assert fit_gate(rec, Target("kl", 0.05)) == 1.0         # fall back on the two most uncertain
    assert gate_metrics(rec, 1.0)["random"]["kl"] == pytest.approx(0.5 * 0.175)
    assert fit_gate(rec, Target("kl", 1.0)) == math.inf


# -- exactness across mode switches, k and sequences (the cache holds only what the mode's contract allows) --

@pytest.mark.parametrize("before", ["fast", "river", "gated"])
def test_exact_after_a_lossy_mode_is_the_backbone(model, before):
    """fast / river / gated decoding leaves river-written K/V; exact mode on the same object must not reuse
    it (it would diverge from the backbone, as it did before the cache's contract was checked)."""
    ref = _llm(model, "backbone")
    llm = _llm(model, before, **({"thresholds": 0.0, "min_exit_layer": 1} if before == "river" else {}))
    for p in PROMPTS[:2]:
        lossy = _gen(llm, p)
        llm.mode = "exact"
        assert _gen(llm, p) == _gen(ref, p)
        llm.mode = before
        assert _gen(llm, p) == lossy   # and back: the lossy mode's own output, not one over exact's cache
    if before == "fast":
        assert lossy != _gen(ref, PROMPTS[1])   # the test can fail: fast mode writes other tokens


def test_a_prompt_cache_state_of_another_mode_is_not_reused(model):
    """llama-cpp-python's prompt cache (set_cache) saved a fast-mode state: exact and backbone mode must decode
    the prompt afresh rather than load river K/V (they did: the cache bypassed the KV contract)."""
    import llama_cpp

    p = "the quick brown fox jumps over the lazy dog and then"
    want = _llm(model, "backbone").create_completion(p + " again", max_tokens=20, temperature=0)["choices"][0]["text"]
    llm = _llm(model, "fast")
    llm.set_cache(llama_cpp.LlamaRAMCache())
    for mode in ("exact", "backbone"):
        llm.mode = "fast"
        lossy = llm.create_completion(p, max_tokens=20, temperature=0)["choices"][0]["text"]
        llm.mode = mode
        llm.decoding.draft_k = 3
        assert llm.create_completion(p + " again", max_tokens=20, temperature=0)["choices"][0]["text"] == want, mode
    llm.mode = "fast"   # a state of its own contract is still loaded
    assert llm.create_completion(p, max_tokens=20, temperature=0)["choices"][0]["text"] == lossy


def test_backbone_after_an_exact_run_cut_after_a_draft_is_exact(model):
    """An exact run cut anywhere in a cycle (here after every token count) leaves the context as backbone mode
    leaves it, holding every emitted token but the last (not accepted drafts nobody saw), and its logits marked
    stale: llama-cpp-python's generate, handed the tokens back (backbone mode, or a request exact mode falls
    back on), decodes the last one again rather than sample from a verify row."""
    p = PROMPTS[0]
    full = _gen(_llm(model, "backbone"), p, n=60)
    llm = _llm(model, "backbone")
    for cut in range(2, 40):
        llm.mode = "backbone"
        _gen(llm, [1, 2, 3], n=2)          # a decode through llama-cpp-python's own path
        llm.mode = "exact"
        llm.decoding.draft_k = 4
        out = _gen(llm, p, n=cut)
        assert out == full[:cut] and llm.n_tokens == len(p) + cut - 1, cut
        llm.mode = "backbone"
        assert _gen(llm, p + out, n=5) == full[cut:cut + 5], cut


def test_seeded_sampling_in_exact_mode_repeats(model):
    """The same seed, the same text, request after request (as llama.cpp's sampler gives in the other modes)."""
    llm = _llm(model, "exact")
    llm.decoding.draft_k = 3
    outs = [llm.create_completion("hello world", max_tokens=24, temperature=1.0, seed=42)["choices"][0]["text"]
            for _ in range(3)]
    assert outs[1] == outs[0] and outs[2] == outs[0] and llm.stats()["drafted"] > 0
    other = llm.create_completion("hello world", max_tokens=24, temperature=1.0, seed=43)["choices"][0]["text"]
    assert other != outs[0]   # the seed is used at all
    # llama.cpp takes the seed as a uint32: -5 is 2**32 - 5, and -1 (LLAMA_DEFAULT_SEED) means a random one
    neg = [llm.create_completion("hello world", max_tokens=24, temperature=1.0, seed=s)["choices"][0]["text"]
           for s in (-5, 2**32 - 5)]
    assert neg[0] == neg[1] and neg[0]
    # random seeds: two calls draw two seeds (a tiny model may end at once, with its end token: texts, not lengths)
    rand = {llm.create_completion("hello world", max_tokens=24, temperature=1.0, seed=-1)["choices"][0]["text"]
            for _ in range(4)}
    assert len(rand) > 1


def test_gated_with_logprobs_falls_back_and_says_so(model):
    """Gated mode never fills the logits of every position: with logits_all it decodes on the backbone, so the
    logprobs are real ones, and stats() says why; a later call without them is gated again."""
    ref = _llm(model, "backbone", logits_all=True)
    llm = _llm(model, "gated", logits_all=True)
    got = llm.create_completion("hello world", max_tokens=4, temperature=0, logprobs=2)["choices"][0]["logprobs"]
    want = ref.create_completion("hello world", max_tokens=4, temperature=0, logprobs=2)["choices"][0]["logprobs"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    assert "logits_all" in llm.stats()["spec_off"]
    ex = _llm(model, "exact")
    _gen(ex, PROMPTS[0], n=4, grammar=llama_grammar())
    assert ex.stats()["spec_off"] == "grammar"
    _gen(ex, PROMPTS[0], n=4)
    assert ex.stats()["spec_off"] is None    # this call speculated


def llama_grammar():
    from llama_cpp import LlamaGrammar

    return LlamaGrammar.from_string('root ::= [a-z ]+', verbose=False)


def test_changing_thresholds_drops_the_cache(model):
    a = _llm(model, "river", thresholds=0.0, min_exit_layer=1)
    want = _gen(a, PROMPTS[0])
    b = _llm(model, "river")            # tiny GGUFs: thresholds +inf, the backbone's output
    _gen(b, PROMPTS[0])
    b.thresholds, b.min_exit_layer = 0.0, 1
    assert _gen(b, PROMPTS[0]) == want


def test_exact_greedy_does_not_depend_on_k(model):
    """k drawn at random every cycle (0..8): the greedy output is the backbone's, 256 tokens."""
    rng = np.random.default_rng(0)
    ref, ex = _llm(model, "backbone", n_ctx=512), _llm(model, "exact", n_ctx=512)
    ex.decoding.draft_k = lambda: int(rng.integers(0, 9))
    for p in PROMPTS[:2]:
        assert _gen(ex, p, n=256) == _gen(ref, p, n=256)
    assert ex.stats()["cycles"] > 0


def test_exact_prompt_is_prefilled_as_backbone_mode_does(model):
    """The whole prompt in one batch, first token from its logits: exact's first token is the backbone's
    even for a prompt longer than n_batch (chunks as Llama.eval makes them)."""
    p = [int(x) for x in np.random.default_rng(1).integers(1, 250, 40)]
    ref, ex = _llm(model, "backbone", n_batch=16), _llm(model, "exact", n_batch=16)
    assert _gen(ex, p, n=8) == _gen(ref, p, n=8)


def test_exact_leaves_other_sequences_alone(model, monkeypatch):
    import llama_cpp

    default = llama_cpp.llama_cpp.llama_context_default_params

    def two_seqs():
        p = default()
        p.n_seq_max, p.kv_unified = 2, True
        return p
    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_context_default_params", two_seqs)
    ex = _llm(model, "exact")
    ex.eval(PROMPTS[3])
    mem = llama_cpp.llama_get_memory(ex.ctx)
    llama_cpp.llama_memory_seq_cp(mem, 0, 1, 0, -1)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 1) == len(PROMPTS[3]) - 1
    ex.reset()
    out = _gen(ex, PROMPTS[0])          # no common prefix: sequence 0 is cleared from position 0
    assert llama_cpp.llama_memory_seq_pos_max(mem, 1) == len(PROMPTS[3]) - 1
    monkeypatch.undo()
    assert out == _gen(_llm(model, "backbone"), PROMPTS[0])


@pytest.mark.parametrize("arch, base_type, backbone, river", [("llama", "q4_1", "keep", "q2_k"),
                                                              ("qwen2", "q4_1", "q8_0", "q3_k"),
                                                              ("qwen3", "q4_k", "keep", "q4_0")])
def test_exact_over_a_quantized_backbone_is_that_files_output(tmp_path, arch, base_type, backbone, river):
    """`river build --backbone keep|q8_0` with a 2-4 bit river: exact mode writes what stock llama.cpp writes
    from the plain file of that backbone (the source itself for keep), token for token."""
    import llama_cpp
    from gguf import GGMLQuantizationType as T

    from river_edge.gguf_tools.build import build_river
    from river_edge.gguf_tools.convert import plain
    from river_edge.gguf_tools.reader import open_gguf
    from river_edge.gguf_tools.tiny import write_tiny_model

    base = write_tiny_model(tmp_path / "base.gguf", arch, n_embd=256, n_ff=512, wtype=base_type, seed=3)
    rv = build_river(base, tmp_path / "river.gguf", backbone=backbone, river=river)
    types = {t.name: t.tensor_type for t in open_gguf(rv).tensors}
    assert types["river.blk.0.ffn_up.weight"] == {"q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_0": T.Q4_0}[river]
    assert types["blk.0.ffn_up.weight"] == ({"q4_1": T.Q4_1, "q4_k": T.Q4_K}[base_type] if backbone == "keep" else T.Q8_0)
    ref_path = base if backbone == "keep" else plain(rv, tmp_path / "backbone.gguf", "backbone")
    ref = llama_cpp.Llama(str(ref_path), n_ctx=256, seed=0, verbose=False)       # stock code, the plain file
    ex = _llm(rv, "exact")
    ex.decoding.draft_k = 3
    for p in PROMPTS:
        # no reset: both reuse the cached prefix alike (a cell from a 4-row batch is not a 2-row one's)
        assert _gen(ex, p) == _gen(ref, p)
    # it drafts, unless no batch size's rows are exact on this CPU (a departing repacked layout on ARM)
    assert ex.stats()["drafted"] > 0 or ex.stats()["cost_model"]["exact_batch"] == 1


@pytest.mark.parametrize("base_type", ["q4_0", "q4_k"])
@pytest.mark.parametrize("backbone", ["keep", "q8_0"])
def test_exact_with_flash_attention_over_a_quantized_backbone(tmp_path, backbone, base_type):
    """Exact mode under flash attention over a quantized backbone (a context of 256 cells: no lone row splits its KV):
    where the verification rows are invariant the probe finds no departure at any batch size; where a repacked
    layout departs (the k-quants' i8mm layouts on ARM) it measures one and the guard decides; either way the cost model drafts
    on its own (no fixed k), and the output is what stock llama.cpp writes from the plain file with flash attention,
    token for token."""
    import llama_cpp

    from river_edge.gguf_tools.build import build_river
    from river_edge.gguf_tools.convert import plain
    from river_edge.gguf_tools.tiny import write_tiny_model

    base = write_tiny_model(tmp_path / "base.gguf", "qwen2", n_embd=256, n_ff=512, wtype=base_type, seed=3)
    rv = build_river(base, tmp_path / "river.gguf", backbone=backbone)
    ex = _llm(rv, "exact", flash_attn=True)
    ref_path = base if backbone == "keep" else plain(rv, tmp_path / "backbone.gguf", "backbone")
    ref = llama_cpp.Llama(str(ref_path), n_ctx=256, seed=0, verbose=False, flash_attn=True)
    for p in PROMPTS:
        # no reset: both reuse the cached prefix alike (a cell from a 4-row batch is not a 2-row one's)
        assert _gen(ex, p) == _gen(ref, p)
    st = ex.stats()
    dev = st["cost_model"]["batch_deviation"]
    assert st["drafted"] > 0 and (max(dev) == 0.0) == ex.batch_invariant, (dev, ex.departing)
    assert st["cost_model"]["usable_batch"][:3] == [True] * 3


def test_greedy_accept_keeps_the_agreeing_prefix():
    from river_edge.runtime.sampling import agree

    assert agree([4, 5, 6], [4, 5, 6, 7]) == 3 and agree([4, 9, 6], [4, 5, 6, 7]) == 1 and agree([], [3]) == 0


def test_margin_is_the_top_two_gap():
    """The near-tie test's margin against a full sort: shared maxima, the top at either end, a given argmax."""
    from river_edge.runtime.sampling import margin

    rng = np.random.default_rng(0)
    for row in [rng.standard_normal(1000).astype(np.float32) for _ in range(20)] + [
            np.array([3.0, 1.0, 3.0], np.float32), np.array([5.0, 1.0, 2.0], np.float32),
            np.array([1.0, 2.0, 5.0], np.float32), np.array([7.0], np.float32)]:
        s = np.sort(row)
        want = float(s[-1] - s[-2]) if len(row) > 1 else math.inf
        assert margin(row) == want and margin(row, int(row.argmax())) == want


def test_drafts_and_verifications_run_on_the_decode_threads(model, monkeypatch):
    """Prefill on n_threads_batch, the draft-verify loop on n_threads (a batch of 2+ tokens would otherwise get
    the prefill's threads: on a busy 2-core machine exact mode ran at 0.2 tok/s), then the setting back."""
    import llama_cpp

    calls = []
    real = llama_cpp.llama_set_n_threads
    monkeypatch.setattr(llama_cpp, "llama_set_n_threads", lambda ctx, a, b: (calls.append((a, b)), real(ctx, a, b))[1])
    ref = _gen(_llm(model, "backbone", n_threads=1, n_threads_batch=2), PROMPTS[0])
    ex = _llm(model, "exact", n_threads=1, n_threads_batch=2)
    assert _gen(ex, PROMPTS[0]) == ref
    assert calls == [(1, 1), (1, 2)] and ex.stats()["cycles"] > 0


@pytest.mark.parametrize("abandoned,running", [("exact", "exact"), ("exact", "backbone"), ("gated", "fast")])
def test_an_abandoned_stream_leaves_a_running_call_alone(model, abandoned, running):
    """A stream its caller stopped reading and that is closed later (by a server's cleanup or the garbage collector)
    while another call runs: its cleanup must not cut that call's cache, nor reset its exit or threads."""
    llm = _llm(model, running, n_ctx=512)
    p1, p2 = "the cat sat", "a long river runs through the old town and on to the sea"
    # streamed as the call under test is: a stream drops a byte token that does not complete a character, which
    # the whole text may join with its neighbours (random models write such bytes)
    ref = "".join(c["choices"][0]["text"] for c in llm.create_completion(p2, max_tokens=40, temperature=0, stream=True))
    llm.mode = abandoned
    g1 = llm.create_completion(p1, max_tokens=200, temperature=0, stream=True)
    for _ in range(5):
        next(g1)
    llm.mode = running
    g2 = llm.create_completion(p2, max_tokens=40, temperature=0, stream=True)
    got = [next(g2)["choices"][0]["text"] for _ in range(8)]
    g1.close()
    got += [c["choices"][0]["text"] for c in g2]
    assert "".join(got) == ref
    # and a stream closed while it still owns the model cuts the cache back as backbone decoding leaves it: every
    # token it emitted but the last
    llm.mode = "exact"
    g3 = llm.generate(PROMPTS[0], temp=0.0)
    [next(g3) for _ in range(3)]
    llm.end_streams()
    assert llm.n_tokens == len(PROMPTS[0]) + 2


@pytest.mark.parametrize("mode", ["backbone", "exact"])
def test_max_tokens_holds_while_bytes_start_characters_without_end(tiny_llama, mode):
    """llama-cpp-python skips its max_tokens check while the text ends in the start of a multi-byte character: a
    model writing only such bytes ran to the end of the context. The cap holds (three tokens' grace)."""
    llm = _llm(tiny_llama, mode)
    lead = next(t for t in range(llm.n_vocab()) if llm.detokenize([t]) == b"\xf7")
    out = llm.create_completion("hello", max_tokens=8, temperature=0, logit_bias={lead: 100.0})
    assert 8 <= out["usage"]["completion_tokens"] <= 11 and llm.n_tokens < 32


def test_each_mode_yields_tokens_that_say_whose_draft_stood(tiny_qwen2):
    """One typed step result per token (runtime/token.py), what chat and the benchmarks read: the mode, and whose
    draft stood there. Run to the end of the context, so every cycle's tokens are read: exact mode's drafted tokens
    are its accepted drafts, gated mode's are the river's tokens the gate let stand."""
    from river_edge.runtime.token import Token
    p = [1, 5, 9, 200, 5, 9, 200, 5, 9]
    bb = _llm(tiny_qwen2, "backbone")
    n = bb.n_ctx() - len(p) + 1   # the context's worth (the last never decoded: backbone mode's loop would fail there)
    want = _gen(bb, p, n=n)
    assert all(isinstance(t, Token) and (t.mode, t.draft) == ("backbone", None) for t in want)
    for drafter in ("ngram", "river"):
        ex = _llm(tiny_qwen2, "exact", drafter=drafter)
        ex.decoding.draft_k = 4
        got = list(ex.generate(p, temp=0.0))
        assert got == want and {t.mode for t in got} == {"exact"} and {t.draft for t in got} == {drafter, None}
        assert sum(t.draft is not None for t in got) == ex.stats()["accepted"] == ex.stats()["call_drafted"] > 0
    for gate, stood in ((0.0, None), (math.inf, "river")):
        g = list(_llm(tiny_qwen2, "gated", gate=gate).generate(p, temp=0.0))
        assert len(g) == n and g[0].draft is None and {t.draft for t in g[1:]} == {stood}   # g[0]: the prompt's
    s = Token(7, "exact", "ngram")
    assert s == 7 and str(s) == f"{s}" == "7" and hash(s) == hash(7) and repr(s) == "Token(7, 'exact', 'ngram')"


def test_the_end_of_call_report_sees_each_call_and_cannot_change_how_it_ends(tiny_qwen2):
    """Spec.on_call_end (what `river serve` logs) gets every call's summary, a call cut short included; a report
    that fails warns and leaves the call's tokens as they were."""
    p = [1, 5, 9, 200, 5, 9, 200, 5, 9]
    ex = _llm(tiny_qwen2, "exact", drafter="ngram")
    seen = []
    ex.decoding.on_call_end = seen.append
    want = _gen(ex, p, n=12)
    gen = ex.generate(p, temp=0.0)
    next(gen), gen.close()
    assert [s["tokens"] for s in seen] == [12, 1] and seen[0]["mode"] == "exact"
    assert 0 <= seen[0]["drafted"] <= 12 and seen[0]["tok_s"] > 0

    def broken(_):
        raise OSError("the log is gone")
    ex.decoding.on_call_end = broken
    with pytest.warns(RuntimeWarning, match="on_call_end failed: OSError: the log is gone"):
        assert _gen(ex, p, n=12) == want
