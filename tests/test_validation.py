"""One set of rules for river keys (river_edge/format.py), applied alike by the patched loader (C++),
`river validate` / `inspect`, and RiverLlama's setters: the same bad files and values fed to each."""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as V

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.gguf_tools.inspect import format_report, inspect_gguf, validate

from gguf_edit import DROP, rewrite

R = pytest.importorskip("river_edge.runtime.llama")
capi = pytest.importorskip("river_edge.runtime.capi")
needs_runtime = pytest.mark.skipif(not capi.runtime_is_patched(), reason="needs the patched llama-cpp-python")

L = 4  # the tiny models' layers
BAD_KEYS = {
    "version 999": {F.KEY_VERSION: (999, V.UINT32)},
    "version missing": {F.KEY_VERSION: DROP},
    "version as string": {F.KEY_VERSION: ("1", V.STRING)},
    "version as i32": {F.KEY_VERSION: (1, V.INT32)},      # the loader reads a u32: validate() must refuse it too
    "min exit 4e9": {F.KEY_MIN_EXIT: (4_000_000_000, V.UINT32)},
    "min exit = n_layer": {F.KEY_MIN_EXIT: (L, V.UINT32)},
    "min exit as f32": {F.KEY_MIN_EXIT: (1.0, V.FLOAT32)},
    "threshold -1": {F.KEY_THRESHOLDS: ([-1.0] * L, V.ARRAY, V.FLOAT32)},
    "threshold -inf": {F.KEY_THRESHOLDS: ([-math.inf] * L, V.ARRAY, V.FLOAT32)},
    "threshold 1.5": {F.KEY_THRESHOLDS: ([0.9, 1.5, 0.9, 0.9], V.ARRAY, V.FLOAT32)},
    "threshold nan": {F.KEY_THRESHOLDS: ([0.9, math.nan, 0.9, 0.9], V.ARRAY, V.FLOAT32)},
    "thresholds as i32": {F.KEY_THRESHOLDS: ([1] * L, V.ARRAY, V.INT32)},
    "thresholds as string": {F.KEY_THRESHOLDS: ("0.9", V.STRING)},
    "thresholds length": {F.KEY_THRESHOLDS: ([0.9] * (L - 1), V.ARRAY, V.FLOAT32)},
    "gate nan": {F.KEY_GATE: (math.nan, V.FLOAT32)},
    "gate -1": {F.KEY_GATE: (-1.0, V.FLOAT32)},
    "gate as string": {F.KEY_GATE: ("abc", V.STRING)},
    "gate as a numeric string": {F.KEY_GATE: ("0.5", V.STRING)},   # the loader reads the gate as validate() does
    "gate as u32": {F.KEY_GATE: (1, V.UINT32)},
}
GOOD_KEYS = {
    "thresholds 0, 0.5, 1, inf": {F.KEY_THRESHOLDS: ([0.0, 0.5, 1.0, math.inf], V.ARRAY, V.FLOAT32)},
    "min exit 0, gate 0": {F.KEY_MIN_EXIT: (0, V.UINT32), F.KEY_GATE: (0.0, V.FLOAT32)},
    "gate inf": {F.KEY_GATE: (math.inf, V.FLOAT32)},
}


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_bad_keys_refused_by_validate_inspect_and_loader(case, tiny_llama, tmp_path):
    bad = rewrite(tiny_llama, tmp_path / "bad.gguf", keys=BAD_KEYS[case])
    problems = validate(bad)
    assert problems and all("\n" not in p and "Traceback" not in p for p in problems), problems
    info = inspect_gguf(bad)
    assert info["problems"]
    format_report(info)   # never a traceback, whatever the keys hold
    if capi.runtime_is_patched():
        with pytest.raises(RiverError) as e:
            R.RiverLlama(str(bad), n_ctx=64, n_threads=1)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", list(GOOD_KEYS))
def test_good_keys_accepted_by_both(case, tiny_llama, tmp_path):
    ok = rewrite(tiny_llama, tmp_path / "ok.gguf", keys=GOOD_KEYS[case])
    assert validate(ok) == []
    if capi.runtime_is_patched():
        llm = R.RiverLlama(str(ok), n_ctx=64, n_threads=1)
        th = GOOD_KEYS[case].get(F.KEY_THRESHOLDS)
        if th:
            assert llm.thresholds == th[0]
        from river_edge.runtime.spec import DEFAULT_GATE

        g = GOOD_KEYS[case].get(F.KEY_GATE)   # as the loader read it (llama_model_river_gate)
        assert llm.gate == (g[0] if g else DEFAULT_GATE)


@needs_runtime
@pytest.mark.parametrize("attr, value", [
    ("thresholds", "0.5"), ("thresholds", [0.5] * (L - 1)), ("thresholds", -0.1), ("thresholds", math.nan),
    ("thresholds", [0.5, 0.5, 0.5, 2.0]), ("thresholds", None), ("thresholds", True),
    ("min_exit_layer", 1.7), ("min_exit_layer", L), ("min_exit_layer", -1), ("min_exit_layer", "1"),
    ("forced_exit", 1.7), ("forced_exit", L), ("forced_exit", -2), ("forced_exit", -4), ("forced_exit", "0"),
    ("decide", "fast"), ("decide", None), ("decide", 1),
    ("gate", "abc"), ("gate", math.nan), ("gate", -0.5),
])
def test_bad_settings_are_river_errors(tiny_llama, attr, value):
    llm = R.RiverLlama(str(tiny_llama), n_ctx=64, n_threads=1)
    before = getattr(llm, attr)
    with pytest.raises(RiverError, match=attr.split("_")[0].rstrip("s")):
        setattr(llm, attr, value)
    assert getattr(llm, attr) == before   # a refused value changes nothing


@needs_runtime
def test_numbers_of_any_kind_are_accepted(tiny_llama):
    llm = R.RiverLlama(str(tiny_llama), n_ctx=64, n_threads=1)
    llm.thresholds = np.float32(0.25)
    assert llm.thresholds == [0.25] * L
    llm.thresholds = np.array([0.5, 0.5, 1.0, np.inf])
    assert llm.thresholds == [0.5, 0.5, 1.0, math.inf]
    llm.min_exit_layer, llm.forced_exit, llm.gate = np.int64(2), np.int32(1), np.float64(1.5)
    assert (llm.min_exit_layer, llm.forced_exit, llm.gate) == (2, 1, 1.5)


def test_a_header_claiming_more_than_the_file_is_refused_at_once(tmp_path):
    """A 200-byte file whose array claims 2^40 elements: one line, no allocation (gguf-py would try)."""
    s = lambda x: struct.pack("<Q", len(x)) + x.encode()  # noqa: E731
    path = tmp_path / "huge.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + s("general.architecture") + struct.pack("<I", 8)
                     + s("llama") + s("x") + struct.pack("<IIQ", 9, 0, 2**40) + b"\0" * 100)
    problems = validate(path)
    assert len(problems) == 1 and "claims" in problems[0] and "truncated or corrupt GGUF" in problems[0]
    with pytest.raises(RiverError, match="claims"):
        inspect_gguf(path)


def test_stale_part_files_of_a_killed_build_are_swept(tiny_llama_base, tmp_path):
    from river_edge.gguf_tools.build import build_river

    out = tmp_path / "m.river.gguf"
    dead = tmp_path / f".{out.name}.999999999.abc.part"      # no such pid
    alive = tmp_path / f".{out.name}.{os.getpid()}.def.part"  # a live writer: left alone
    other = tmp_path / ".other.gguf.999999999.x.part"           # another output: not ours
    # a killed calibrated build: the uncalibrated river's own temporary file, inside the outer one's name
    nested = tmp_path / f"..{out.name}.999999999.g.uncalibrated.gguf.999999999.h.part"
    for p in (dead, alive, other, nested):
        p.write_bytes(b"x" * 100)
    build_river(tiny_llama_base, out)
    assert out.is_file() and not dead.exists() and not nested.exists() and alive.exists() and other.exists()


def test_temporary_files_of_a_long_output_name_fit_and_are_swept(tiny_llama_base, tmp_path):
    """A temporary file's name was the output's plus ~40 characters ("File name too long" for a 235-byte one);
    it now starts with at most 64 bytes of it, and a killed run's are swept all the same."""
    from river_edge.defaults import build_calibrated_river
    from river_edge.calibration.target import Settings

    out = tmp_path / ("a" * 230 + ".gguf")
    dead = tmp_path / f".{'a' * 64}.999999999.abc.part"
    nested = tmp_path / f"..{'a' * 63}.999999999.h.part"     # the uncalibrated river's own temporary file
    alive = tmp_path / f".{'a' * 64}.{os.getpid()}.def.part"
    other = tmp_path / f".{'a' * 63}b.999999999.x.part"     # another output's
    for p in (dead, nested, alive, other):
        p.write_bytes(b"x" * 100)
    s = Settings(n_prompts=2, decode_tokens=2, online_tokens=2, prompts=["What is 1 plus 1?", "Hi"])
    build_calibrated_river(tiny_llama_base, out, settings=s)
    assert out.is_file() and Path(f"{out}.calibration.png").is_file() and Path(f"{out}.calibration.json").is_file()
    # with the head drafter's ranking of the vocabulary, from the base model's own greedy text
    from river_edge.gguf_tools.inspect import head_ranking
    from river_edge.runtime import headrank

    base = R.RiverLlama(str(tiny_llama_base), n_ctx=512, mode="backbone")
    assert np.array_equal(head_ranking(out), headrank.rank(base))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted([alive.name, other.name])


@pytest.mark.parametrize("count", [4_000_000_000, 1000, "4"])
def test_a_corrupt_layer_count_is_one_problem_not_a_loop(tiny_llama, tmp_path, count):
    """block_count sizes every per-layer loop of validate/inspect: one the tensors cannot hold is refused first."""
    bad = rewrite(tiny_llama, tmp_path / "bad.gguf",
                  keys={"llama.block_count": (count, V.STRING if isinstance(count, str) else V.UINT32)})
    problems = validate(bad)
    assert len(problems) == 1 and "block_count" in problems[0], problems
    info = inspect_gguf(bad)
    assert info["n_layer"] is None and info["river_tensor_types"] == [] and info["problems"] == problems
    format_report(info)


@needs_runtime
def test_a_bad_decide_fails_before_the_model_exists(tiny_llama, capfd):
    """Refused in __new__: a half-made Llama would print an ignored AttributeError from its __del__."""
    import gc

    with pytest.raises(RiverError, match="decide"):
        R.RiverLlama(str(tiny_llama), n_ctx=64, n_threads=1, decide="bogus")
    gc.collect()
    assert "Exception ignored" not in capfd.readouterr().err


@needs_runtime
@pytest.mark.parametrize("kw", [dict(n_ctx=2**32 + 1), dict(n_ctx=-1), dict(n_threads=100_000), dict(n_threads_batch=0),
                                dict(n_ctx=1.5)])
def test_loading_limits_are_checked_before_llama_cpp(tiny_llama, kw):
    """A context of 2^32 + 1 wrapped to 1 in llama.cpp and aborted; 10^11 ran out of memory; 10^5 threads
    crashed: each is a one-line RiverError before anything is allocated."""
    with pytest.raises(RiverError, match=next(iter(kw))):
        R.RiverLlama(str(tiny_llama), **{"n_ctx": 64, "n_threads": 1, **kw})


def test_calibration_sizes_are_bounded():
    from river_edge.calibration.target import Settings

    for kw in (dict(online_tokens=10**11), dict(n_prompts=1), dict(decode_tokens=0), dict(batch=0)):
        with pytest.raises(RiverError, match=next(iter(kw))):
            Settings(**kw)
    assert Settings(n_prompts=4).n_prompts == 4


def test_a_big_endian_gguf_is_named_as_such(tiny_llama_base, tmp_path):
    data = bytearray(open(tiny_llama_base, "rb").read())
    data[4:8] = struct.pack(">I", struct.unpack("<I", data[4:8])[0])   # the version as a big-endian writer stores it
    p = tmp_path / "be.gguf"
    p.write_bytes(bytes(data))
    assert "big-endian" in validate(p)[0]


def test_a_write_error_that_names_no_file_names_the_output(tmp_path):
    """A full disk (ENOSPC) names no file: the one-line error said only "No space left on device"."""
    import errno

    from river_edge.gguf_tools.writer import replacing, replacing_together

    for ctx, named in ((lambda: replacing(tmp_path / "out.gguf"), "out.gguf"),
                       (lambda: replacing_together([tmp_path / "r.json", tmp_path / "r.gguf"]), "r.gguf")):
        with pytest.raises(OSError) as e:
            with ctx():
                raise OSError(errno.ENOSPC, "No space left on device")
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / named)
        assert sorted(p.name for p in tmp_path.iterdir()) == []   # nothing left either


def test_a_failed_write_leaves_the_existing_output_alone(tmp_path):
    """Only a rename phase cut short removes what it renamed in: an error inside the block (here after the
    temporary file went away) leaves an existing output as it was."""
    from river_edge.gguf_tools.writer import replacing

    dst = tmp_path / "out.json"
    dst.write_text("old")
    with pytest.raises(ValueError):
        with replacing(dst) as tmp:
            tmp.unlink()
            raise ValueError("failed")
    assert dst.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
