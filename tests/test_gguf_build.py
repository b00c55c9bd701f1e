"""build_river / set_river_keys / write_tiny_model: contents of the written river GGUFs."""
import hashlib
import math
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFValueType as V, GGUFWriter
from gguf.quants import dequantize

import river_edge
from river_edge import format as F
from river_edge.format import RiverError
from river_edge.gguf_tools import build_river, quant, set_river_keys, validate, write_tiny_model
from river_edge.gguf_tools.reader import ggml_shape, value

from conftest import ARCHS
from gguf_edit import DROP, rewrite


def tensors(path):
    return {t.name: t for t in GGUFReader(path).tensors}


def keys(path):
    r = GGUFReader(path)
    return {k: value(r, k) for k in r.fields if not k.startswith("GGUF.")}


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def f32(t):
    return dequantize(t.data, t.tensor_type)


@pytest.fixture(params=ARCHS)
def base(request):
    return request.getfixturevalue(f"tiny_{request.param}_base")


def test_keep_carries_everything_over(base, tmp_path):
    before = sha(base)
    out = build_river(base, tmp_path / "r.gguf", backbone="keep")
    assert sha(base) == before  # the input is never touched
    src, dst = tensors(base), tensors(out)
    for name, t in src.items():
        assert ggml_shape(dst[name]) == ggml_shape(t) and dst[name].tensor_type == t.tensor_type
        assert np.array_equal(dst[name].data, t.data), name
    src_keys, dst_keys = keys(base), keys(out)
    assert {k: v for k, v in dst_keys.items() if not k.startswith("river.")} == src_keys
    n_layer = src_keys[f"{src_keys['general.architecture']}.block_count"]
    assert set(dst) - set(src) == {F.river_tensor(i, w) for i in range(n_layer) for w in F.LAYER_WEIGHTS} | {F.RIVER_HEAD}
    assert dst_keys[F.KEY_THRESHOLDS] == [math.inf] * n_layer
    assert dst_keys[F.KEY_MIN_EXIT] == 1 and dst_keys[F.KEY_CALIBRATED] is False
    assert dst_keys[F.KEY_FIT_SUMMARY] == "" and dst_keys[F.KEY_IMATRIX_SHA] == ""
    assert dst_keys[F.KEY_SOURCE_SHA] == before and dst_keys[F.KEY_TOOL_VERSION] == river_edge.__version__
    assert dst_keys[F.KEY_BACKBONE_TYPE] == "keep" and dst_keys[F.KEY_LAYER_TYPES] == ["q4_0"] * n_layer
    assert validate(out) == []


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_f16_backbone_is_the_source_upcast(fixture, request):
    river = request.getfixturevalue(fixture)
    src, dst = tensors(request.getfixturevalue(fixture + "_base")), tensors(river)
    for name, t in src.items():
        d = dst[name]
        assert ggml_shape(d) == ggml_shape(t)
        if len(t.shape) >= 2:
            assert d.tensor_type == T.F16
            assert np.array_equal(d.data, f32(t).astype(np.float16)), name
        else:
            assert d.tensor_type == T.F32 and np.array_equal(d.data, t.data)
    assert keys(river)["general.file_type"] == 1


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_upcast_report_counts_the_weights_the_f16_backbone_moved(fixture, request):
    """bench/upcast.py (the docs' "how close the backbone is to the shipped file") counts exactly the weights
    whose value in the built F16 backbone differs from the source's, each within F16's rounding."""
    from bench.upcast import measure_upcast

    src, dst = tensors(request.getfixturevalue(fixture + "_base")), tensors(request.getfixturevalue(fixture))
    moved = sum(int((f32(dst[n]) != f32(t)).sum()) for n, t in src.items() if len(t.shape) >= 2)
    r = measure_upcast(request.getfixturevalue(fixture + "_base"))
    assert r["weights"] == sum(f32(t).size for t in src.values() if len(t.shape) >= 2)
    assert sum(d["moved"] for d in r["types"].values()) == moved and 0 < moved < r["weights"]
    assert 0 < r["max_rel"] <= 2.0 ** -11


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_river_is_ggml_quantization_of_the_backbone(fixture, request):
    river = request.getfixturevalue(fixture)
    ts = tensors(river)
    rivers = [t for n, t in ts.items() if n.startswith("river.blk.")]
    assert len(rivers) == 4 * len(F.LAYER_WEIGHTS)
    for t in rivers:
        b = ts[t.name.removeprefix("river.")]
        assert t.tensor_type == T.Q4_0 and ggml_shape(t) == ggml_shape(b)
        mine = quant.quantize(f32(b), "q4_0")
        assert np.array_equal(t.data, mine), t.name
        assert np.array_equal(f32(t), dequantize(mine, T.Q4_0))


def test_reader_reads_every_field_as_gguf_py_does(tiny_llama_base, tmp_path):
    """open_gguf reads arrays in one pass (gguf-py's element-by-element walk took seconds on a large vocabulary):
    every field, value and type reads as through the stock reader, strings byte for byte."""
    from river_edge.gguf_tools.reader import open_gguf, raw_value

    odd = {"test.empty": ([], V.ARRAY, V.INT32), "test.empty_strs": ([], V.ARRAY, V.STRING),
           "test.strs": (["", "\u00e9\u4e2d", "a b"], V.ARRAY, V.STRING), "test.f64s": ([1e300, -2.0], V.ARRAY, V.FLOAT64),
           "test.bools": ([True, False], V.ARRAY, V.BOOL), "test.u8": ([0, 255], V.ARRAY, V.UINT8)}
    src = rewrite(tiny_llama_base, tmp_path / "odd.gguf", keys=odd)
    ours, stock = open_gguf(src), GGUFReader(src)
    assert list(ours.fields) == list(stock.fields) and "tokenizer.ggml.tokens" in ours.fields
    for k, f in stock.fields.items():
        if not k.startswith("GGUF."):
            g = ours.fields[k]
            assert (raw_value(g), g.types, g.contents()) == (raw_value(f), f.types, f.contents()), k
            assert value(ours, k) == value(stock, k), k
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in stock.tensors]


def test_odd_keys_survive(tiny_llama_base, tmp_path):
    odd = {"test.empty": ([], V.ARRAY, V.INT32), "test.empty_str": ("", V.STRING), "test.bytes": ("\u00e9\u4e2d", V.STRING),
           "test.f64": (1e300, V.FLOAT64), "test.i8": (-3, V.INT8)}
    src = rewrite(tiny_llama_base, tmp_path / "odd.gguf", keys=odd)
    out = build_river(src, tmp_path / "r.gguf", backbone="keep")
    r = GGUFReader(out)
    assert r.fields["test.empty"].parts[3][0] == V.INT32 and value(r, "test.empty") == []
    assert {k: value(r, k) for k in odd if k != "test.empty"} == {k: v[0] for k, v in odd.items() if k != "test.empty"}


def test_q8_0_backbone(tiny_qwen2_base, tmp_path):
    out = build_river(tiny_qwen2_base, tmp_path / "r.gguf", backbone="q8_0", river="q5_1")
    src, dst = tensors(tiny_qwen2_base), tensors(out)
    for name, t in src.items():
        want = T.Q8_0 if len(t.shape) >= 2 else T.F32
        assert dst[name].tensor_type == want
        assert np.array_equal(dst[name].data, t.data)  # the source is Q8_0 already: kept, not re-quantized
    for i in range(4):
        r, b = dst[F.river_tensor(i, "ffn_up")], dst[F.backbone_tensor(i, "ffn_up")]
        assert r.tensor_type == T.Q5_1 and np.array_equal(r.data, quant.quantize(f32(b), "q5_1"))
    assert keys(out)["general.file_type"] == 7


def test_q8_0_backbone_requantizes_other_types(tiny_llama_base, tmp_path):
    out = build_river(tiny_llama_base, tmp_path / "r.gguf", backbone="q8_0")
    src, dst = tensors(tiny_llama_base), tensors(out)
    t = src["blk.0.attn_q.weight"]
    assert np.array_equal(dst[t.name].data, quant.quantize(f32(t), "q8_0"))


def test_per_layer_types_and_k_fallback(tiny_llama_base, tmp_path):
    types = ["q8_0", "q5_0", "q4_1", "q4_k"]
    out = build_river(tiny_llama_base, tmp_path / "r.gguf", layer_types=types)
    ts = tensors(out)
    want = {0: T.Q8_0, 1: T.Q5_0, 2: T.Q4_1, 3: T.Q5_0}  # q4_k with rows of 64/128 -> q5_0, as llama-quantize
    for i, qt in want.items():
        assert {ts[F.river_tensor(i, w)].tensor_type for w in F.LAYER_WEIGHTS} == {qt}
    assert keys(out)[F.KEY_LAYER_TYPES] == types and keys(out)[F.KEY_TYPE] == "q4_0"
    assert validate(out) == []


def test_imatrix_for_q4_k(tmp_path):
    base = write_tiny_model(tmp_path / "b.gguf", "llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=256)
    rng = np.random.default_rng(3)
    im = {F.backbone_tensor(i, w): rng.uniform(0.1, 10, 256).astype(np.float32) for i in range(2) for w in F.LAYER_WEIGHTS}
    a = build_river(base, tmp_path / "a.gguf", river="q4_k", imatrix=im)
    plain = build_river(base, tmp_path / "p.gguf", river="q4_k")
    ta, tp = tensors(a), tensors(plain)
    for name, w in im.items():
        r = ta["river." + name]
        assert r.tensor_type == T.Q4_K
        assert np.array_equal(r.data, quant.quantize(f32(ta[name]), "q4_k", w))
        assert not np.array_equal(r.data, tp["river." + name].data)
    assert len(keys(a)[F.KEY_IMATRIX_SHA]) == 64 and keys(plain)[F.KEY_IMATRIX_SHA] == ""

    # the same importance as a llama-imatrix GGUF (<name>.in_sum2 / <name>.counts) gives the same river
    w = GGUFWriter(tmp_path / "imatrix.gguf", "imatrix")
    for name, v in im.items():
        w.add_tensor(name + ".in_sum2", (v * 4).reshape(1, -1))  # x4 / 4: exact in float32
        w.add_tensor(name + ".counts", np.array([[4.0]], np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    b = build_river(base, tmp_path / "b2.gguf", river="q4_k", imatrix=tmp_path / "imatrix.gguf")
    tb = tensors(b)
    assert all(np.array_equal(tb["river." + n].data, ta["river." + n].data) for n in im)
    assert keys(b)[F.KEY_IMATRIX_SHA] == sha(tmp_path / "imatrix.gguf")


def _imatrix(path, sums, counts, name="blk.0.attn_q.weight"):
    w = GGUFWriter(path, "imatrix")
    w.add_tensor(name + ".in_sum2", sums)
    w.add_tensor(name + ".counts", counts)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


ONE = np.ones((1,), np.float32)


@pytest.mark.parametrize("sums, counts, fragment", [
    (np.full((1, 64), np.nan, np.float32), ONE, "values that are not finite"),
    (np.full((1, 64), np.inf, np.float32), ONE, "values that are not finite"),
    (np.zeros((1, 64), np.float32), ONE, "all zero"),
    (np.full((1, 64), -1.0, np.float32), ONE, "negative values"),
    (np.ones((1, 64), np.float32), np.zeros((1,), np.float32), "count 0 is not a positive number"),
    (np.ones((2, 64), np.float32), np.ones((3,), np.float32), "in_sum2 of shape [64, 2] and 3 counts do not match"),
    (np.ones((2, 2, 64), np.float32), np.ones((2, 2), np.float32), "in_sum2 has 3 dimensions"),
    (np.ones((2, 64), np.float32), np.ones((2,), np.float32), "2 matrices; a dense weight has one"),
    (np.ones((1, 64), np.int8), np.ones((1,), np.int8), "in_sum2 / counts are I8 / I8, not F32"),
], ids=["nan", "inf", "zero", "negative", "no count", "broadcast", "3-d", "experts", "int8"])
def test_a_bad_imatrix_is_one_line_naming_file_and_tensor(tiny_llama_base, tmp_path, sums, counts, fragment):
    """NaN/inf importance made every river weight NaN and all-zero made them zero (exit 0 both); a counts tensor
    that does not match in_sum2 was a numpy broadcast traceback."""
    im = _imatrix(tmp_path / "im.gguf", sums, counts)
    dst = tmp_path / "out.gguf"
    with pytest.raises(RiverError) as e:
        build_river(tiny_llama_base, dst, imatrix=im)
    assert str(e.value).startswith(f"{im}: importance matrix for blk.0.attn_q.weight: ") and fragment in str(e.value)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # the dict form is checked as well
    if sums.dtype == np.float32 and sums.shape == (1, 64) and counts[0] == 1:
        with pytest.raises(RiverError, match=f"importance matrix for blk.0.attn_q.weight: {fragment}"):
            build_river(tiny_llama_base, dst, imatrix={"blk.0.attn_q.weight": sums[0]})


def test_set_river_keys(tiny_llama, tmp_path):
    path = shutil.copy(tiny_llama, tmp_path / "r.gguf")
    before = tensors(tiny_llama)
    set_river_keys(path, path, thresholds=[0.9, 0.8, 0.7, math.inf], min_exit_layer=2, calibrated=True,
                   fit_summary='{"ok": 1}')
    k = keys(path)
    assert k[F.KEY_THRESHOLDS] == pytest.approx([0.9, 0.8, 0.7, math.inf])
    assert (k[F.KEY_MIN_EXIT], k[F.KEY_CALIBRATED], k[F.KEY_FIT_SUMMARY]) == (2, True, '{"ok": 1}')
    assert {n: v for n, v in k.items() if n not in (F.KEY_THRESHOLDS, F.KEY_MIN_EXIT, F.KEY_CALIBRATED, F.KEY_FIT_SUMMARY)} == \
        {n: v for n, v in keys(tiny_llama).items() if n not in (F.KEY_THRESHOLDS, F.KEY_MIN_EXIT, F.KEY_CALIBRATED, F.KEY_FIT_SUMMARY)}
    after = tensors(path)
    assert all(np.array_equal(after[n].data, t.data) and ggml_shape(after[n]) == ggml_shape(t) for n, t in before.items())
    assert validate(path) == []
    set_river_keys(path, tmp_path / "again.gguf", calibrated=False)  # untouched keys stay
    assert keys(tmp_path / "again.gguf")[F.KEY_MIN_EXIT] == 2


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(thresholds=[0.5]), "need 4 values"),
    (dict(thresholds=[0.5, math.nan, 1, 1]), r"thresholds\[1\] nan out of range"),
    (dict(thresholds=[-0.5] * 4), "out of range"),          # the loader and validate() refuse negatives
    (dict(thresholds=[0.5, 0.5, 0.5, 2.0]), "out of range"),
    (dict(min_exit_layer=4), "out of range 0..3"),
    (dict(min_exit_layer=1.7), "whole number"),               # not truncated to 1
    (dict(gate_entropy=-1.0), "out of range"),
    (dict(gate_entropy=math.nan), "out of range"),
])
def test_set_river_keys_rejects(tiny_llama, tmp_path, kwargs, fragment):
    """The writer applies format.py's rules, the loader's and validate()'s."""
    with pytest.raises(RiverError, match=fragment):
        set_river_keys(tiny_llama, tmp_path / "x.gguf", **kwargs)
    assert not (tmp_path / "x.gguf").exists()
    ok = set_river_keys(tiny_llama, tmp_path / "ok.gguf", thresholds=[0.0, 0.5, 1.0, math.inf], gate_entropy=math.inf)
    assert validate(ok) == []


def test_set_river_keys_needs_a_river_gguf(tiny_llama_base, tmp_path):
    with pytest.raises(RiverError, match="not a river GGUF"):
        set_river_keys(tiny_llama_base, tmp_path / "x.gguf", calibrated=True)


def test_dst_equal_src_refused(tiny_llama_base, tmp_path, monkeypatch):
    copy = shutil.copy(tiny_llama_base, tmp_path / "m.gguf")
    before = sha(copy)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.gguf").symlink_to(copy)
    for dst in (copy, "m.gguf", tmp_path / "." / "m.gguf", tmp_path / "link.gguf"):
        with pytest.raises(RiverError, match="would overwrite the input"):
            build_river(copy, dst)
    assert sha(copy) == before and sorted(p.name for p in tmp_path.iterdir()) == ["link.gguf", "m.gguf"]


def _phi3(tmp_path):
    w = GGUFWriter(tmp_path / "phi3.gguf", "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return tmp_path / "phi3.gguf"


@pytest.mark.parametrize("case, fragment", [
    ("missing", "missing.gguf: file not found"),
    ("not gguf", "not a GGUF file (bad magic)"),
    ("truncated", "truncated"),
    ("phi3", "unsupported architecture 'phi3': river-edge supports llama, qwen2, qwen3, gemma3, mistral3"),
    ("river", "already a river GGUF"),
    ("no ffn_gate", "tensor blk.1.ffn_gate.weight is missing"),
    ("backbone", "unknown backbone type 'q4_0'"),
    ("river type", "unknown river type 'q7_k'"),
    ("layer types", "layer_types has 3 entries; the model has 4 layers"),
    ("dst folder", "does not exist"),
    ("imatrix length", "importance matrix for blk.0.attn_q.weight has 3 values"),
])
def test_bad_input(case, fragment, tiny_llama_base, tiny_llama, tmp_path):
    src, dst, kw = tiny_llama_base, tmp_path / "out.gguf", {}
    if case == "missing":
        src = tmp_path / "missing.gguf"
    elif case == "not gguf":
        src = tmp_path / "x.gguf"
        src.write_bytes(b"PK\x03\x04 not a model")
    elif case == "truncated":
        src = tmp_path / "t.gguf"
        src.write_bytes(tiny_llama_base.read_bytes()[:5000])
    elif case == "phi3":
        src = _phi3(tmp_path)
    elif case == "river":
        src = tiny_llama
    elif case == "no ffn_gate":
        src = rewrite(tiny_llama_base, tmp_path / "s.gguf", tensors={"blk.1.ffn_gate.weight": DROP})
    elif case == "backbone":
        kw = dict(backbone="q4_0")
    elif case == "river type":
        kw = dict(river="q7_k")
    elif case == "layer types":
        kw = dict(layer_types=["q4_0"] * 3)
    elif case == "dst folder":
        dst = tmp_path / "nope" / "out.gguf"
    elif case == "imatrix length":
        kw = dict(imatrix={"blk.0.attn_q.weight": np.ones(3)})
    with pytest.raises(RiverError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        build_river(src, dst, **kw)
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_progress_is_reported(tiny_qwen2_base, tmp_path):
    seen = []
    build_river(tiny_qwen2_base, tmp_path / "r.gguf", progress=lambda name, done, total: seen.append((done, total, name)))
    assert [d for d, _, _ in seen] == list(range(len(seen))) and seen[-1][1] == len(seen) - 1
    assert seen[-1][2] == F.RIVER_HEAD and seen[-2][2] == "river.blk.3.ffn_down.weight"


def test_tiny_model(tmp_path):
    p = write_tiny_model(tmp_path / "t.gguf", "qwen2", river="q4_0", backbone="keep")
    assert validate(p) == [] and keys(p)[F.KEY_BACKBONE_TYPE] == "keep"
    assert [f.name for f in tmp_path.iterdir()] == ["t.gguf"]  # the temporary base is gone
    ts = tensors(p)
    assert "blk.0.attn_k.bias" in ts and "output.weight" in ts
    assert keys(p)["tokenizer.chat_template"].startswith("{% for message in messages %}")


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed yet (`make setup` builds it)")


@pytest.mark.parametrize("fixture", ["tiny_llama_base", "tiny_qwen2_base"])
def test_stock_llama_cpp_runs_the_tiny_base(fixture, request, llama_cpp):
    llm = llama_cpp.Llama(model_path=str(request.getfixturevalue(fixture)), n_ctx=64, n_threads=1, n_batch=16,
                          logits_all=True, verbose=False)
    text = b"hello the world, 1 = (x)"
    toks = llm.tokenize(text, add_bos=False)
    assert len(toks) < len(text) and llm.detokenize(toks) == text  # merges apply; bytes round-trip
    llm.eval(toks)
    logits = np.array(llm.scores[: llm.n_tokens])
    assert logits.shape == (len(toks), 285) and np.isfinite(logits).all()
    assert (logits.std(axis=-1) > 0.5).all()  # not degenerate
    assert len(set(logits.argmax(axis=-1))) > 1
    for _ in range(3):  # a few single-token decode steps
        llm.eval([int(logits[-1].argmax())])
        logits = np.array(llm.scores[llm.n_tokens - 1 : llm.n_tokens])
        assert np.isfinite(logits).all()
    chat = llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    assert chat["choices"][0]["message"]["role"] == "assistant"


def _logits(llama_cpp, path, toks):
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(toks)
    return np.array(llm.scores[: llm.n_tokens])


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_stock_llama_cpp_runs_both_halves_of_a_river_gguf(fixture, request, tmp_path, llama_cpp):
    """Stock llama.cpp refuses the extra tensors, so each half is loaded alone: the backbone as written
    (with all river.* keys), and the river swapped in for the backbone matrices."""
    river = request.getfixturevalue(fixture)
    ts = tensors(river)
    rivers = [n for n in ts if n.startswith("river.")]
    backbone = rewrite(river, tmp_path / "backbone.gguf", tensors=dict.fromkeys(rivers, DROP))
    swapped = rewrite(river, tmp_path / "river.gguf", tensors={
        **dict.fromkeys(rivers, DROP),
        **{n.removeprefix("river."): (ggml_shape(ts[n]), ts[n].tensor_type, ts[n].data) for n in rivers}})
    toks = list(range(0, 200, 7))
    base = _logits(llama_cpp, request.getfixturevalue(fixture + "_base"), toks)
    b, r = _logits(llama_cpp, backbone, toks), _logits(llama_cpp, swapped, toks)
    cos = lambda x, y: float((x * y).sum() / np.linalg.norm(x) / np.linalg.norm(y))  # noqa: E731
    assert np.isfinite(b).all() and np.isfinite(r).all()
    assert cos(b, base) > 0.995  # the same weights, F16 instead of the source's Q4_1/Q8_0 kernels
    assert 0.8 < cos(r, b) < 0.9999  # 4-bit copies: close, not equal


def test_runtime_loads_a_river_gguf(tiny_llama, llama_cpp):
    # make setup installs the river-patched build: a stock one refuses the river tensors here
    llm = llama_cpp.Llama(model_path=str(tiny_llama), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval([1, 2, 3])
    assert np.isfinite(np.array(llm.scores[:3])).all()


@pytest.mark.parametrize("head", ["q4_0", "q8_0"])
def test_river_head_quantizes_the_backbone_head(base, tmp_path, head):
    out = build_river(base, tmp_path / "r.gguf", head=head)
    t = tensors(out)
    src = t["output.weight"] if "output.weight" in t else t["token_embd.weight"]  # tied on the qwen2 tiny
    rh = t[F.RIVER_HEAD]
    assert rh.tensor_type == quant.ggml_type(head) and ggml_shape(rh) == ggml_shape(src)
    want = quant.quantize(f32(src).reshape(rh.data.shape[0], -1), quant.ggml_type(head))
    assert np.array_equal(rh.data, want)
    assert validate(out) == []


def test_no_river_head(tiny_llama_base, tmp_path):
    out = build_river(tiny_llama_base, tmp_path / "r.gguf", head="none")
    assert F.RIVER_HEAD not in tensors(out) and validate(out) == []
    with pytest.raises(RiverError, match="unknown head type 'q3'"):
        build_river(tiny_llama_base, tmp_path / "x.gguf", head="q3")


def test_validate_rejects_a_misshapen_river_head(tiny_llama, tmp_path):
    rh = tensors(tiny_llama)[F.RIVER_HEAD]
    n_embd, n_vocab = ggml_shape(rh)
    bad = rewrite(tiny_llama, tmp_path / "bad.gguf",
                  tensors={F.RIVER_HEAD: ((n_embd, n_vocab - 1), T.F32, np.zeros((n_vocab - 1, n_embd), np.float32))})
    assert any("river.output.weight has shape" in p for p in validate(bad))


def test_bad_sources_are_one_line(tiny_llama_base, tmp_path):
    """A 1-layer model builds a valid river (min_exit_layer 0: the only one in range; it drafts in exact mode);
    a split.count of another type and a missing LM head are RiverErrors."""
    from river_edge.gguf_tools.writer import DROP as GONE, copy

    one = build_river(write_tiny_model(tmp_path / "one.gguf", "llama", n_layer=1, seed=3), tmp_path / "r1.gguf")
    assert validate(one) == []
    odd = copy(tiny_llama_base, tmp_path / "split.gguf", keys={"split.count": ("2", V.STRING)})
    with pytest.raises(RiverError, match="split.count"):
        build_river(odd, tmp_path / "r3.gguf")
    headless = copy(tiny_llama_base, tmp_path / "nohead.gguf", tensors={"output.weight": GONE, "token_embd.weight": GONE})
    with pytest.raises(RiverError, match="no LM head"):
        build_river(headless, tmp_path / "r4.gguf")


def test_inspect_reports_keys_of_other_types(tiny_llama, tmp_path):
    from river_edge.gguf_tools.inspect import format_report, inspect_gguf
    from river_edge.gguf_tools.writer import copy

    odd = copy(tiny_llama, tmp_path / "odd.gguf", keys={F.KEY_LAYER_TYPES: (4, V.UINT32), F.KEY_SOURCE_SHA: (7, V.UINT32),
                                                        F.KEY_IMATRIX_SHA: (8, V.UINT32), F.KEY_FIT_SUMMARY: (3, V.UINT32)})
    text = format_report(inspect_gguf(odd))
    assert "made by" in text
