"""validate / check / inspect_gguf: each kind of broken file is named in one line with its path."""
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFValueType as V

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.gguf_tools import check, format_report, inspect_gguf, quant, validate

from gguf_edit import DROP, f32_tensor, rewrite


def test_good_files(tiny_llama, tiny_qwen2, tiny_llama_base):
    assert validate(tiny_llama) == [] and validate(tiny_qwen2) == []
    check(tiny_llama)
    assert validate(tiny_llama_base, require_river=False) == []
    assert "no river tensors" in validate(tiny_llama_base)[0]


def _q4_0(shape):
    x = np.zeros(tuple(reversed(shape)), np.float32)
    return shape, T.Q4_0, quant.quantize(x, "q4_0")


CASES = {
    # name: (what to change, expected fragment)
    "missing river tensor": (dict(tensors={"river.blk.2.attn_v.weight": DROP}), "river tensor river.blk.2.attn_v.weight is missing"),
    "missing backbone tensor": (dict(tensors={"blk.0.ffn_up.weight": DROP}), "backbone tensor blk.0.ffn_up.weight is missing"),
    "river shape": (dict(tensors={"river.blk.1.attn_q.weight": _q4_0((64, 32))}), "river.blk.1.attn_q.weight has shape [64, 32], backbone [64, 64]"),
    "river type": (dict(tensors={"river.blk.1.attn_q.weight": f32_tensor((64, 64))}), "river.blk.1.attn_q.weight has type f32, expected q4_0"),
    "extra river tensor": (dict(tensors={"river.blk.9.attn_q.weight": _q4_0((64, 64))}), "unexpected river tensor river.blk.9.attn_q.weight"),
    "thresholds length": (dict(keys={F.KEY_THRESHOLDS: ([1.0] * 3, V.ARRAY, V.FLOAT32)}), "river.thresholds: need 4 values (one per layer), got 3"),
    "thresholds nan": (dict(keys={F.KEY_THRESHOLDS: ([1.0, math.nan, 1.0, 1.0], V.ARRAY, V.FLOAT32)}), "river.thresholds[1] nan out of range"),
    "min exit": (dict(keys={F.KEY_MIN_EXIT: (4, V.UINT32)}), "river.min_exit_layer 4 out of range 0..3"),
    "version": (dict(keys={F.KEY_VERSION: (2, V.UINT32)}), "river.format_version 2 is not 1"),
    "layer types": (dict(keys={F.KEY_LAYER_TYPES: (["q4_0", "q4_0", "q7_k", "q4_0"], V.ARRAY, V.STRING)}), "unknown river type 'q7_k'"),
    "layer types length": (dict(keys={F.KEY_LAYER_TYPES: (["q4_0"], V.ARRAY, V.STRING)}), "river.layer_types has 1 entries"),
    "backbone type": (dict(keys={F.KEY_BACKBONE_TYPE: ("q6_k", V.STRING)}), "unknown backbone type 'q6_k'"),
    "missing key": (dict(keys={F.KEY_THRESHOLDS: DROP}), "key river.thresholds is missing"),
    "architecture": (dict(arch="phi3", keys={"phi3.block_count": (4, V.UINT32)}), "unsupported architecture 'phi3': river-edge supports llama, qwen2, qwen3, gemma3, mistral3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_broken_river_files(case, tiny_llama, tmp_path):
    change, fragment = CASES[case]
    bad = rewrite(tiny_llama, tmp_path / "bad.gguf", **change)
    problems = validate(bad)
    assert problems and fragment in problems[0], problems
    assert all(p.startswith(str(bad)) and "\n" not in p for p in problems)
    with pytest.raises(RiverError, match="bad.gguf: "):
        check(bad)


def test_wrong_type_for_layer(tiny_llama, tmp_path):
    ok = rewrite(tiny_llama, tmp_path / "ok.gguf", keys={F.KEY_LAYER_TYPES: (["q4_0", "q4_k", "q4_0", "q4_0"], V.ARRAY, V.STRING)})
    # q4_k rows of 64 fall back to q5_0 as llama-quantize does; q4_0 is neither
    assert "river.blk.1.attn_q.weight has type q4_0, expected q4_k/q5_0" in validate(ok)[0]


@pytest.mark.parametrize("case, fragment", [
    ("missing", "nothere.gguf: file not found"),
    ("folder", "not a file"),
    ("empty", "not a GGUF file (bad magic)"),
    ("magic", "not a GGUF file (bad magic)"),
    ("header cut", "truncated or corrupt GGUF"),
    ("data cut", "truncated"),
])
def test_unreadable_files(case, fragment, tiny_llama, tmp_path):
    data = tiny_llama.read_bytes()
    path = tmp_path / "nothere.gguf"
    if case == "folder":
        path = tmp_path
    elif case != "missing":
        path = tmp_path / f"{case}.gguf"
        path.write_bytes({"empty": b"", "magic": b"GGML" + data[4:], "header cut": data[:300],
                          "data cut": data[:-1000]}[case])
    problems = validate(path)
    assert len(problems) == 1 and fragment in problems[0] and str(path) in problems[0]
    with pytest.raises(RiverError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        inspect_gguf(path)


def test_inspect(tiny_qwen2, tiny_llama_base):
    info = inspect_gguf(tiny_qwen2)
    assert (info["architecture"], info["n_layer"], info["n_embd"], info["vocab"]) == ("qwen2", 4, 64, 285)
    assert info["river"] and info["format_version"] == 1 and info["problems"] == []
    assert info["river_tensor_types"] == [["q4_0"]] * 4 and info["layer_types"] == ["q4_0"] * 4
    assert info["thresholds"] == [math.inf] * 4 and info["min_exit_layer"] == 1 and info["calibrated"] is False
    assert info["backbone_types"] == {"f16": 29, "f32": 21}  # tied embeddings: no output.weight
    assert info["river_bpw"] == pytest.approx(4.5) and 16 < info["backbone_bpw"] < 16.2
    assert info["backbone_bytes"] + info["river_bytes"] < info["file_bytes"]
    text = format_report(info)
    assert "qwen2" in text and "4.50 bits/weight" in text and "never exits" in text

    base = inspect_gguf(tiny_llama_base)
    assert not base["river"] and base["backbone_types"] == {"q4_1": 30, "f32": 9} and base["problems"] == []
    assert "none (a base model)" in format_report(base)


def _vocab(path) -> int:
    from river_edge.gguf_tools.reader import n_vocab_of, open_gguf
    return n_vocab_of(open_gguf(path))


@pytest.mark.parametrize("case", ["short", "repeat", "out of range", "float"])
def test_a_bad_head_ranking_is_one_problem_for_validate_and_the_runtime(case, tiny_llama, tmp_path):
    """river.head_ranking (head drafting's vocabulary order) is every token id once: validate() and the runtime's
    reader (runtime/headrank.py through inspect.head_ranking) apply format.check_ranking alike."""
    from river_edge.gguf_tools.inspect import head_ranking

    n = _vocab(tiny_llama)
    ids = list(range(n))[::-1]
    value, sub, fragment = {
        "short": (ids[:-1], V.INT32, f"need {n} token ids"),
        "repeat": (ids[:-1] + [ids[0]], V.INT32, "must appear once"),
        "out of range": (ids[:-1] + [n], V.INT32, "must appear once"),
        "float": ([float(i) for i in ids], V.FLOAT32, "must be array of int32, not array of float32"),
    }[case]
    bad = rewrite(tiny_llama, tmp_path / "bad.gguf", keys={F.KEY_HEAD_RANKING: (value, V.ARRAY, sub)})
    problems = validate(bad)
    assert len(problems) == 1 and F.KEY_HEAD_RANKING in problems[0] and fragment in problems[0], problems
    with pytest.raises(RiverError, match=fragment):
        head_ranking(bad)
    good = rewrite(tiny_llama, tmp_path / "good.gguf", keys={F.KEY_HEAD_RANKING: (ids, V.ARRAY, V.INT32)})
    assert validate(good) == [] and head_ranking(good).tolist() == ids
    assert head_ranking(tiny_llama) is None
