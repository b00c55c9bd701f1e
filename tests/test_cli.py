"""The `river` command line, driven in-process with typer's runner on the tiny GGUFs.

Calibrations here use 4 short prompts of 4 decode tokens: about a second each on the tiny model (whose
character-level vocabulary makes the packaged prompts hundreds of tokens long).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import stat
from pathlib import Path

import pytest

from river_edge.calibration import prompts as P, target as C
from river_edge import defaults as D
from river_edge import format as F
from river_edge import zoo
from river_edge.cli import build as CB, convert as CC
from river_edge.cli.main import app
from river_edge.format import RiverError
from river_edge.gguf_tools.reader import open_gguf, value

from gguf_edit import DROP, rewrite

SHORT = [f"What is {i} plus {i}?" for i in range(6)]
QUICK = ["--n-prompts", "4", "--decode-tokens", "4", "--online-tokens", "8"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """QUICK plus a file of short prompts."""
    path = tmp_path_factory.mktemp("prompts") / "short.txt"
    path.write_text("\n".join(SHORT) + "\n")
    return QUICK + ["--prompts", str(path)]



def run(runner, *args, code=0):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), \
        f"uncaught {r.exception!r}\n{r.output}"  # the runner swallows tracebacks: never let one through
    assert "Traceback" not in r.output
    assert r.exit_code == code, f"exit {r.exit_code}, wanted {code}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def one_error_line(r, fragment: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("river: error: "), r.stderr
    assert fragment in lines[0], lines[0]


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- help ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", [[], ["build"], ["calibrate"], ["inspect"], ["validate"], ["convert"],
                                 ["models"], ["models", "prepare"], ["demo"], ["doctor"]])
def test_help_with_an_example_everywhere(runner, cmd):
    r = run(runner, *cmd, "--help")
    assert "Usage: river" in r.stdout and "Example" in r.stdout


def test_no_arguments_shows_help(runner):
    r = runner.invoke(app, [])
    assert "Commands" in r.output and "build" in r.output


def test_version(runner):
    from river_edge.runtime.capi import runtime_is_patched

    out = run(runner, "--version").stdout
    assert "river-edge" in out and ("patched (build" in out) == runtime_is_patched()


def test_doctor(runner, tiny_llama):
    from river_edge.runtime.capi import runtime_is_patched

    if not runtime_is_patched():
        pytest.skip("the buffer types of a river GGUF need the patched llama-cpp-python")
    out = run(runner, "doctor", str(tiny_llama), "-t", "1").stdout
    assert "cpu " in out and "ISA" in out and "devices" in out
    assert f"rivers for  {', '.join(F.ARCHITECTURES)}" in out
    # every weight accounted for, with extra buffer types on and off (off: plain CPU buffers only)
    on, off = (next(l for l in out.splitlines() if l.startswith(f"extra bufts {x}")) for x in ("on", "off"))
    assert "backbone" in on and "river " in on and "AMX" not in off and "REPACK" not in off
    r = runner.invoke(app, ["doctor", "nothere.gguf"])
    assert r.exit_code == 1 and "no such file" in r.output


def test_cli_choices_follow_the_library():
    from river_edge.gguf_tools.convert import CONVERSIONS

    assert {m.value for m in CC.ConvertTo} == set(CONVERSIONS)
    assert [m.value for m in CB.RiverType] == list(F.RIVER_TYPES)
    assert CB.DEFAULT_KL == D.DEFAULT_TARGET.value and D.DEFAULT_TARGET.kind == "kl"
    import inspect

    for command in (CB.build, CB.calibrate_command):
        params = inspect.signature(command).parameters
        assert params["n_prompts"].default == C.Settings().n_prompts
        assert params["decode_tokens"].default == C.Settings().decode_tokens
        assert params["online_tokens"].default == C.Settings().online_tokens


# -- build ---------------------------------------------------------------------------------------------

def test_build_calibrates_in_one_go(runner, tiny_llama_base, tmp_path, quick):
    before = sha(tiny_llama_base)
    out = tmp_path / "out.gguf"
    r = run(runner, "build", tiny_llama_base, "-o", out, *quick, "--max-kl", "0.05")
    assert "rule (fitted)" in r.stdout and "verdict" in r.stdout
    assert f"report {out}.calibration.png" in r.stdout and f"report {out}.calibration.json" in r.stdout
    reader = open_gguf(out)
    assert value(reader, F.KEY_CALIBRATED) is True
    assert value(reader, F.KEY_TYPE) == "q4_0" and value(reader, F.KEY_BACKBONE_TYPE) == "f16"
    summary = json.loads(value(reader, F.KEY_FIT_SUMMARY))
    assert summary["source"] == "out.gguf"  # not the temporary file's name
    assert summary["target"] == {"kind": "kl", "value": 0.05}
    assert summary["settings"]["n_prompts"] == 4 and summary["settings"]["decode_tokens"] == 4
    assert summary["settings"]["online_tokens"] == 8 and summary["fit_online"]["tokens_per_prompt"] == 8
    assert Path(f"{out}.calibration.png").stat().st_size > 0
    # each step's wall time, on a named host (issue 41: a 10-minute build recorded none)
    took = json.loads(Path(f"{out}.calibration.json").read_text())
    assert {"build_river_gguf", "load_model", "backbone_decode", "record_fit_prompts", "online_fit_checks",
            "gate_fit_and_checks"} \
        <= set(took["seconds"]) and all(v >= 0 for v in took["seconds"].values())
    assert took["host"]["cpus"] >= 1 and took["host"]["model"]
    assert sha(tiny_llama_base) == before
    assert leftovers(tmp_path) == []  # the uncalibrated temporary is gone


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_killed_build_leaves_nothing_behind(tiny_llama_base, tmp_path, sig):
    """SIGTERM (a `timeout`, a closed session) and Ctrl-C mid-build: the command's cleanup runs, so neither the
    uncalibrated temporary river (hundreds of MB on a real model) nor a half-written output stays."""
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "short.txt").write_text("\n".join(SHORT * 4) + "\n")
    folder = tmp_path / "out"
    folder.mkdir()
    # 1500 tokens per prompt, every prompt four times: a calibration of many seconds on the tiny model (the one-pass
    # checks made one prompt each finish within a second), so the signal lands inside it
    proc = subprocess.Popen([sys.executable, "-m", "river_edge.cli.main", "build", str(tiny_llama_base), "-o",
                             str(folder / "out.gguf"), "--online-tokens", "1500", "--prompts", str(tmp_path / "short.txt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as from a terminal: a suite started in the background (`make test &`) ignores SIGINT,
                            # and so would the build it starts, finishing with 0
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not list(folder.glob(".out.gguf.*.uncalibrated.gguf")):   # the build has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(0.3)   # into the build or the calibration
        assert proc.poll() is None
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == {"SIGTERM": 143, "SIGINT": 130}[sig], err
    assert sorted(p.name for p in folder.iterdir()) == []


def test_build_without_calibration_and_with_types(runner, tiny_llama_base, tmp_path):
    out = tmp_path / "raw.gguf"
    r = run(runner, "build", tiny_llama_base, "-o", out, "--no-calibrate", "--backbone", "q8_0",
            "--layer-types", "q4_0,q5_0,Q8_0,q4_k")
    assert "uncalibrated" in r.stdout
    reader = open_gguf(out)
    assert value(reader, F.KEY_CALIBRATED) is False
    assert all(math.isinf(x) for x in value(reader, F.KEY_THRESHOLDS))
    assert value(reader, F.KEY_LAYER_TYPES) == ["q4_0", "q5_0", "q8_0", "q4_k"]
    assert value(reader, F.KEY_BACKBONE_TYPE) == "q8_0"
    assert not Path(f"{out}.calibration.json").exists()
    out2 = tmp_path / "q5.gguf"
    run(runner, "build", tiny_llama_base, "-o", out2, "--no-calibrate", "--river", "Q5_1", "--backbone", "keep")
    assert value(open_gguf(out2), F.KEY_TYPE) == "q5_1"


def test_build_refuses_to_overwrite_its_input(runner, tiny_llama_base, tmp_path):
    src = tmp_path / "base.gguf"
    shutil.copy(tiny_llama_base, src)
    link = tmp_path / "link.gguf"
    link.symlink_to(src)
    before = sha(src)
    for out in (src, link, tmp_path / "sub" / ".." / "base.gguf"):
        r = run(runner, "build", src, "-o", out, *QUICK, code=1)
        one_error_line(r, "overwrite the input")
    assert sha(src) == before


# -- calibrate -----------------------------------------------------------------------------------------

def test_calibrate_beside_the_input_with_a_prompt_file(runner, tiny_llama, tmp_path):
    river = tmp_path / "model.gguf"
    shutil.copy(tiny_llama, river)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in SHORT))
    r = run(runner, "calibrate", river, *QUICK, "--prompts", prompts, "--min-agreement", "0.5", "--rule", "single")
    out = tmp_path / "model.calibrated.gguf"
    assert f"wrote {out}" in r.stdout
    summary = json.loads(value(open_gguf(out), F.KEY_FIT_SUMMARY))
    assert summary["rule"] == "single" and summary["target"] == {"kind": "agreement", "value": 0.5}
    assert value(open_gguf(river), F.KEY_CALIBRATED) is False  # never in place


def test_calibrate_with_plain_text_prompts_and_depth_target(runner, tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(SHORT[:5]) + "\n\n")
    out = tmp_path / "fast.gguf"
    r = run(runner, "calibrate", tiny_llama, "-o", out, *QUICK, "--prompts", prompts, "--max-depth", "3")
    assert "target depth = 3.0" in r.stdout
    assert value(open_gguf(out), F.KEY_CALIBRATED) is True


def test_calibrate_refuses_in_place_and_base_models(runner, tiny_llama, tiny_llama_base, tmp_path):
    one_error_line(run(runner, "calibrate", tiny_llama, "-o", tiny_llama, code=1), "would overwrite the input")
    one_error_line(run(runner, "calibrate", tiny_llama_base, "-o", tmp_path / "x.gguf", code=1), "no river tensors")
    assert not (tmp_path / "x.gguf").exists()


def test_read_prompts(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "one"}\n\n{"prompt": "two", "answer": 2}\n')
    assert P.read_prompts(tmp_path / "a.jsonl") == ["one", "two"]
    (tmp_path / "b.txt").write_text("first line\n  \nsecond line\n")
    assert P.read_prompts(tmp_path / "b.txt") == ["first line", "second line"]
    (tmp_path / "c.jsonl").write_text('{"prompt": "ok"}\n{"question": "no"}\n')
    with pytest.raises(RiverError, match=r"c.jsonl:2: .*prompt"):
        P.read_prompts(tmp_path / "c.jsonl")
    (tmp_path / "d.txt").write_text("\n\n")
    with pytest.raises(RiverError, match="no prompts"):
        P.read_prompts(tmp_path / "d.txt")
    # a byte-order mark, separators str.splitlines would cut at, a plain prompt that starts with "{"
    (tmp_path / "f.jsonl").write_text('\ufeff{"prompt": "one\u2028two"}\n{"prompt": "x\\fy"}\n', encoding="utf-8")
    assert P.read_prompts(tmp_path / "f.jsonl") == ["one\u2028two", "x\fy"]
    (tmp_path / "g.txt").write_text("\ufeff{1,2,3}: list all subsets\nExplain:\x0cdef f(): pass\n", encoding="utf-8")
    assert P.read_prompts(tmp_path / "g.txt") == ["{1,2,3}: list all subsets", "Explain:\x0cdef f(): pass"]
    (tmp_path / "e.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(RiverError, match="UTF-8"):
        P.read_prompts(tmp_path / "e.txt")


def test_a_prompts_file_is_read_within_bounds(runner, tiny_llama_base, tmp_path):
    """--prompts /dev/zero read 2.7 GB, then a traceback: what a prompts file may hold is bounded."""
    out = tmp_path / "out.gguf"
    one_error_line(run(runner, "build", tiny_llama_base, "-o", out, "--prompts", "/dev/zero", code=1),
                   "/dev/zero: more than 16 MiB")
    (tmp_path / "long.txt").write_text("Hi\n" + "x" * (P.MAX_LINE_CHARS + 1) + "\n")
    with pytest.raises(RiverError, match=r"long.txt:2: a line of 1,048,577 characters; a prompt line holds at most"):
        P.read_prompts(tmp_path / "long.txt")
    (tmp_path / "many.txt").write_text("x\n" * P.MAX_LINES + "x")   # 256 KB that were millions of strings at 16 MiB
    with pytest.raises(RiverError, match=r"many.txt: 131,073 lines; a calibration prompts file holds at most 131,072"):
        P.read_prompts(tmp_path / "many.txt")
    (tmp_path / "many.txt").write_text("x\n" * P.MAX_LINES)   # the bound itself is read
    assert len(P.read_prompts(tmp_path / "many.txt")) == P.MAX_LINES
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_prompt_too_long_to_calibrate_is_refused_by_its_line(runner, tiny_llama_base, tiny_llama, tmp_path):
    """One 20,000-word prompt tried to allocate 57 GB (a torch traceback). A prompt past the calibration's bound,
    or past the model's context with the tokens decoded after it, is refused naming its line, before the build."""
    prompts, out = tmp_path / "p.txt", tmp_path / "out.gguf"
    prompts.write_text("What is 1 plus 1?\n" + "word " * 3000 + "\nHi\n")
    r = run(runner, "build", tiny_llama_base, "-o", out, "--prompts", prompts, "--n-prompts", "3",
            "--decode-tokens", "1", "--online-tokens", "1", code=1)
    one_error_line(r, f"{prompts}:2: a prompt of ")
    assert "tokens; calibration takes at most 8,192" in r.stderr and "building" not in r.output
    # ~1,800 tokens: within the tiny model's context of 2048, but not with 300 decoded after it
    prompts.write_text("What is 1 plus 1?\n\n" + "word " * 600 + "\n")
    r = run(runner, "calibrate", tiny_llama, "-o", out, "--prompts", prompts, "--n-prompts", "2",
            "--decode-tokens", "1", "--online-tokens", "300", code=1)
    one_error_line(r, f"{prompts}:3: a prompt of ")
    assert "with the 300 decoded after it, passes the model's context of 2,048 tokens" in r.stderr
    assert not out.exists() and leftovers(tmp_path) == []
    run(runner, "calibrate", tiny_llama, "-o", out, "--prompts", prompts, "--n-prompts", "2",
        "--decode-tokens", "1", "--online-tokens", "2")
    assert out.is_file()


def test_output_names_long_and_ending_in_a_separator(runner, tiny_llama_base, tiny_llama, tmp_path):
    """A 235-byte output name (the limit is 255) failed with "File name too long": the temporary file's name was
    ~40 characters longer. `-o new/` (a folder that does not exist) wrote a file named new."""
    out = tmp_path / ("a" * 230 + ".gguf")
    run(runner, "convert", tiny_llama_base, "-o", out, "--to", "q8_0")
    assert out.is_file() and leftovers(tmp_path) == []
    for args in (["convert", tiny_llama_base, "-o", f"{tmp_path}/new/", "--to", "q8_0"],
                 ["build", tiny_llama_base, "-o", f"{tmp_path}/new/", "--no-calibrate"],
                 ["calibrate", tiny_llama, "-o", f"{tmp_path}/new/"]):
        one_error_line(run(runner, *args, code=1), f"{tmp_path}/new/: ends in a separator, so it names a folder")
    assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []


# -- inspect, validate ---------------------------------------------------------------------------------

def test_inspect(runner, tiny_llama, tiny_llama_base):
    r = run(runner, "inspect", tiny_llama)
    assert "river     format 1" in r.stdout and "never exits" in r.stdout
    info = json.loads(run(runner, "inspect", tiny_llama, "--json").stdout)
    assert info["river"] is True and info["thresholds"] == ["inf"] * info["n_layer"]  # valid JSON, no Infinity
    assert "river     none" in run(runner, "inspect", tiny_llama_base).stdout


def test_inspect_shows_the_fit(runner, tiny_llama, tmp_path, quick):
    out = tmp_path / "cal.gguf"
    run(runner, "calibrate", tiny_llama, "-o", out, *quick)
    assert "fit       target kl 0.05" in run(runner, "inspect", out).stdout
    info = json.loads(run(runner, "inspect", out, "--json").stdout)
    assert info["calibrated"] is True and info["fit_summary"]["target"]["kind"] == "kl"


def test_validate(runner, tiny_llama, tiny_llama_base, tmp_path):
    assert "ok, a river GGUF, uncalibrated" in run(runner, "validate", tiny_llama).stdout
    one_error_line(run(runner, "validate", tiny_llama_base, code=1), "no river tensors")
    assert "ok, a base GGUF" in run(runner, "validate", tiny_llama_base, "--base").stdout
    broken = rewrite(tiny_llama, tmp_path / "broken.gguf",
                     tensors={F.river_tensor(0, "attn_q"): DROP, F.river_tensor(2, "ffn_up"): DROP})
    r = run(runner, "validate", broken, code=1)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("river: error: ") and "is missing" in ln for ln in lines)
    short = tmp_path / "short.gguf"
    short.write_bytes(Path(tiny_llama).read_bytes()[:100_000])
    one_error_line(run(runner, "validate", short, code=1), "truncated")


# -- convert, models, demo -----------------------------------------------------------------------------

def test_convert(runner, tiny_llama, tiny_llama_base, tmp_path):
    q4 = tmp_path / "q4.gguf"
    assert f"wrote {q4}" in run(runner, "convert", tiny_llama_base, "-o", q4, "--to", "q4_0").stdout
    assert run(runner, "validate", q4, "--base").exit_code == 0
    for mode in ("backbone", "river"):
        out = tmp_path / f"{mode}.gguf"
        run(runner, "convert", tiny_llama, "-o", out, "--to", mode)
        assert not any(t.name.startswith("river.") for t in open_gguf(out).tensors)
    one_error_line(run(runner, "convert", tiny_llama_base, "-o", tmp_path / "x.gguf", "--to", "river", code=1),
                   "no river tensors")
    one_error_line(run(runner, "convert", q4, "-o", q4, "--to", "f16", code=1), "overwrite the input")


def test_models_lists_without_downloading(runner, tmp_path):
    r = run(runner, "models")
    for name in zoo.MODELS:
        assert name in r.stdout
    assert str(tmp_path / "cache") in r.stdout
    rows = json.loads(run(runner, "models", "--json").stdout)["models"]
    assert {x["name"]: (x["prepared"], x["supported"]) for x in rows}["gemma3-270m"] == (False, True)
    other = tmp_path / "elsewhere"
    assert str(other) in json.loads(run(runner, "models", "--json", "--cache-dir", other).stdout)["cache"]


def test_models_prepare(runner, monkeypatch, tmp_path):
    calls = []

    def fake_prepare(name, progress=None):
        calls.append((name, str(zoo.cache_dir())))
        progress(f"{name}: downloading", 0, 0)
        return zoo.model_path(name)
    monkeypatch.setattr(zoo, "prepare", fake_prepare)
    r = run(runner, "models", "prepare", "smollm2-135m", "gemma3-270m", "smollm2-135m", "--cache-dir", tmp_path / "c")
    assert calls == [("smollm2-135m", str(tmp_path / "c")), ("gemma3-270m", str(tmp_path / "c"))]
    assert "gemma3-270m" in r.stdout and "unsupported" not in r.stdout
    one_error_line(run(runner, "models", "prepare", "smollm2-135m", "nosuch", code=1), "no such model 'nosuch'")
    assert len(calls) == 2  # nothing was fetched for a list with an unknown name


def test_demo(runner, monkeypatch, tiny_llama, tmp_path, quick):
    out = tmp_path / "default.gguf"
    run(runner, "calibrate", tiny_llama, "-o", out, *quick)
    monkeypatch.setattr(D, "default_river", lambda progress=None: out)
    r = run(runner, "demo")
    assert f"default river GGUF: {out}" in r.stdout and "rule (fitted)" in r.stdout
    assert "river chat" in r.stdout and f"report {out}.calibration.png" in r.stdout


def test_default_river_is_built_once(monkeypatch, tiny_llama_base, tmp_path):
    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path))
    spec = zoo.MODELS[zoo.DEFAULT_MODEL]
    monkeypatch.setitem(zoo.MODELS, zoo.DEFAULT_MODEL, dataclasses.replace(spec, sha256=sha(tiny_llama_base)))
    monkeypatch.setattr(zoo, "default_model", lambda progress=None: Path(tiny_llama_base))
    monkeypatch.setattr(D, "Settings", lambda: C.Settings(n_prompts=4, decode_tokens=4, online_tokens=8, prompts=SHORT))
    seen = []
    path = D.default_river(lambda what, done, total: seen.append(what))
    assert path == tmp_path / "rivers" / "smollm2-135m.river.gguf"
    assert value(open_gguf(path), F.KEY_CALIBRATED) is True and seen
    stamp = path.stat().st_mtime_ns
    assert D.default_river() == path and path.stat().st_mtime_ns == stamp  # reused
    # a river made from another model (the pinned one changed) is rebuilt
    monkeypatch.setitem(zoo.MODELS, zoo.DEFAULT_MODEL, dataclasses.replace(spec, sha256="0" * 64))
    assert not D._usable(path)
    # and so is one an older release fitted with other settings (its online check over fewer tokens)
    monkeypatch.setitem(zoo.MODELS, zoo.DEFAULT_MODEL, dataclasses.replace(spec, sha256=sha(tiny_llama_base)))
    assert D._usable(path)
    monkeypatch.setattr(D, "Settings", lambda: C.Settings(n_prompts=4, decode_tokens=4, online_tokens=16, prompts=SHORT))
    assert not D._usable(path)


# -- errors --------------------------------------------------------------------------------------------

@pytest.fixture
def files(tiny_llama, tiny_llama_base, tmp_path):
    (tmp_path / "text.gguf").write_text("hello, not a model\n")
    (tmp_path / "short.gguf").write_bytes(Path(tiny_llama).read_bytes()[:100_000])
    rewrite(tiny_llama_base, tmp_path / "phi3.gguf", arch="phi3")   # an architecture without a river
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt field"}\n')
    os.mkfifo(tmp_path / "pipe.gguf")   # a special file as output: a rename over it would replace it (/dev/null)
    (tmp_path / "adir.gguf").mkdir()
    return {"river": tiny_llama, "base": tiny_llama_base, "text": tmp_path / "text.gguf",
            "short": tmp_path / "short.gguf", "phi3": tmp_path / "phi3.gguf", "out": tmp_path / "out.gguf",
            "missing": tmp_path / "missing.gguf", "badprompts": tmp_path / "bad.jsonl", "tmp": tmp_path,
            "pipe": tmp_path / "pipe.gguf", "adir": tmp_path / "adir.gguf"}


FAILURES = [  # exit 1: one line on stderr
    (["build", "{missing}", "-o", "{out}"], "no such file or model"),
    (["build", "{text}", "-o", "{out}"], "not a GGUF file"),
    (["build", "{short}", "-o", "{out}"], "truncated"),
    (["build", "{phi3}", "-o", "{out}", "--no-calibrate"], "unsupported architecture 'phi3'"),
    (["build", "{river}", "-o", "{out}"], "already a river GGUF"),
    (["build", "{base}", "-o", "{tmp}/nodir/out.gguf"], "does not exist"),
    (["build", "{base}", "-o", "{tmp}"], "folder"),
    (["build", "{base}", "-o", "{out}", "--layer-types", "q4_0,q8_0"], "layer_types has 2 entries"),
    (["build", "{base}", "-o", "{out}", "--imatrix", "{missing}"], "file not found"),
    (["build", "{base}", "-o", "{out}", "--prompts", "{missing}"], "file not found"),
    (["build", "{base}", "-o", "{out}", "--max-depth", "4"], "not below the model's 4"),    # the backbone meets it
    (["calibrate", "{river}", "-o", "{out}", "--max-depth", "1000"], "give a depth below 4"),
    (["build", "{base}", "-o", "{out}", "--prompts", "{badprompts}"], "prompt"),
    (["calibrate", "{base}", "-o", "{out}"], "no river tensors"),
    (["calibrate", "{missing}"], "file not found"),
    (["calibrate", "{short}", "-o", "{out}"], "truncated"),
    (["calibrate", "{river}", "-o", "{tmp}/nodir/out.gguf"], "does not exist"),
    (["calibrate", "{river}", "-o", "{adir}"], "a folder"),                  # refused before calibrating
    (["build", "{base}", "-o", "{pipe}", "--no-calibrate"], "not a regular file"),
    (["convert", "{river}", "-o", "{pipe}", "--to", "q8_0"], "not a regular file"),
    (["convert", "{river}", "-o", "{adir}", "--to", "q8_0"], "a folder"),
    (["inspect", "{text}"], "not a GGUF file"),
    (["inspect", "{missing}"], "file not found"),
    (["inspect", "gemma3-270m"], "not prepared here; `river models prepare gemma3-270m`"),
    (["validate", "{phi3}"], "unsupported architecture"),
    (["validate", "{missing}"], "file not found"),
    (["convert", "{missing}", "-o", "{out}", "--to", "q8_0"], "no such file or model"),
    (["convert", "{phi3}", "-o", "{out}", "--to", "q8_0"], "unsupported architecture"),
    (["models", "prepare", "nosuch"], "no such model"),
]

USAGE = [  # exit 2: typer's usage message
    ["build", "{base}"],                                           # -o missing
    ["build", "-o", "{out}"],                                      # MODEL missing
    ["build", "{base}", "-o", "{out}", "--river", "q7_k"],
    ["build", "{base}", "-o", "{out}", "--backbone", "q2"],
    ["build", "{base}", "-o", "{out}", "--layer-types", "q4_0,zz"],
    ["build", "{base}", "-o", "{out}", "--max-kl", "-0.1"],
    ["build", "{base}", "-o", "{out}", "--max-kl", "nan"],
    ["build", "{base}", "-o", "{out}", "--max-kl", "inf"],
    ["build", "{base}", "-o", "{out}", "--max-kl", "0.1", "--min-agreement", "0.9"],
    ["build", "{base}", "-o", "{out}", "--min-agreement", "1.5"],
    ["build", "{base}", "-o", "{out}", "--max-depth", "0"],
    ["build", "{base}", "-o", "{out}", "--n-prompts", "1"],
    ["serve", "{river}", "--name", "a:b"],                          # requests name NAME:MODE
    ["serve", "{river}", "--name", ""],
    ["build", "{base}", "-o", "{out}", "--decode-tokens", "-3"],
    ["build", "{base}", "-o", "{out}", "--rule", "double"],
    ["build", "{base}", "-o", "{out}", "--no-calibrate", "--max-kl", "0.1"],
    ["calibrate", "{river}", "--max-depth", "2", "--max-kl", "0.1"],
    ["calibrate", "{river}", "--n-prompts", "x"],
    ["calibrate", "{river}", "--online-tokens", "99999999999"],
    ["build", "{base}", "-o", "{out}", "--n-prompts", "99999"],
    ["bench", "{river}", "--mode", "river", "--draft", "{river}"],  # --draft unused without exact:draft
    ["chat", "{river}", "-p", "hi", "--ctx", "4294967297"],
    ["chat", "{river}", "-p", "hi", "--threads", "100000"],
    ["serve", "{river}", "--threads", "5000"],
    ["convert", "{base}", "-o", "{out}", "--to", "q3"],
    ["convert", "{base}", "-o", "{out}"],                          # --to missing
    ["models", "prepare"],
    ["nosuch-command"],
]


@pytest.mark.parametrize("args,fragment", FAILURES, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_failures_are_one_line(runner, files, args, fragment):
    r = run(runner, *[a.format(**files) for a in args], code=1)
    one_error_line(r, fragment)
    assert not files["out"].exists() and leftovers(files["tmp"]) == []
    assert stat.S_ISFIFO(files["pipe"].stat().st_mode) and files["adir"].is_dir()


@pytest.mark.parametrize("args", USAGE, ids=" ".join)
def test_usage_errors_exit_2(runner, files, args):
    r = run(runner, *[a.format(**files) for a in args], code=2)
    assert "Usage: river" in r.stderr and "river: error" not in r.stderr
    assert not files["out"].exists()


def test_a_model_name_means_its_river_gguf_everywhere(runner, monkeypatch, tiny_llama):
    """chat, serve and eval take a model name as bench does: its river GGUF (built once), not the plain file."""
    asked = []

    def river(progress=None, model=zoo.DEFAULT_MODEL):
        asked.append(model)
        return Path(tiny_llama)
    monkeypatch.setattr(D, "default_river", river)
    r = run(runner, "chat", "qwen2.5-coder-0.5b", "-p", "hi", "-n", "2", "--mode", "exact", "--ctx", "64")
    assert asked == ["qwen2.5-coder-0.5b"] and "exact" in r.output


def test_a_model_name_needs_no_river_where_the_mode_needs_none(runner, monkeypatch, tiny_llama_base):
    """Backbone mode, and exact mode with a drafter that drafts without a river, chat on the model's shipped file:
    prepared, never built into a river GGUF. Exact mode's default drafter (the river) still builds one."""
    prepared, built = [], []
    monkeypatch.setattr(zoo, "prepare", lambda name, progress=None: prepared.append(name) or Path(tiny_llama_base))
    monkeypatch.setattr(D, "default_river", lambda progress=None, model=zoo.DEFAULT_MODEL: built.append(model) or
                        Path(tiny_llama_base))
    for extra in (["--mode", "exact", "--drafter", "ngram"], ["--mode", "exact", "--drafter", "head"],
                  ["--mode", "backbone"], ["--no-river"]):
        run(runner, "chat", "gemma3-270m", "-p", "hi", "-n", "2", "--ctx", "64", *extra)
    assert prepared == ["gemma3-270m"] * 4 and built == []
    run(runner, "chat", "gemma3-270m", "-p", "hi", "-n", "2", "--ctx", "64", "--mode", "exact", "--drafter", "river",
        code=1)   # the river drafter on a file without a river: refused, after the river GGUF was asked for
    assert built == ["gemma3-270m"]


def test_ctrl_c_exits_130_quietly_and_cleans_up(runner, monkeypatch, tiny_llama_base, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(D, "calibrate_file", interrupted)  # after the build, during calibration
    out = tmp_path / "out.gguf"
    r = run(runner, "build", tiny_llama_base, "-o", out, *QUICK, code=130)
    assert "error" not in r.stderr and "Abort" not in r.output
    assert not out.exists() and leftovers(tmp_path) == []


def test_llama_cpp_chatter_is_silenced(tiny_llama, capfd):
    from river_edge.tokenizer import Tokenizer

    Tokenizer(tiny_llama).chat("hello")
    err = capfd.readouterr().err
    assert "llama_context" not in err and "n_ctx" not in err, err


def test_progress_without_a_terminal_is_plain_lines():
    import io

    from rich.console import Console

    from river_edge.cli.progress import Bars

    buf = io.StringIO()
    with Bars(Console(file=buf, force_terminal=False)) as bars:
        bars.say("downloading")
        for i in range(3):
            bars.tensors("building")(f"t{i}", i + 1, 3)
        bars("loading the model", 0, 1)
        bars("recording", 2, 10)
        bars("done", 10, 10)
    assert buf.getvalue().splitlines() == ["downloading", "building", "loading the model", "recording"]
    # a later step of the same bar says what is left, from the bar's rate so far
    import time

    buf = io.StringIO()
    with Bars(Console(file=buf, force_terminal=False)) as bars:
        bars("recording", 0, 10)
        time.sleep(0.2)
        bars("checking", 5, 10)
    first, second = buf.getvalue().splitlines()
    assert first == "recording" and second.startswith("checking (50%; about 0 min 00 s left)"[:15])
    assert "s left)" in second
    # no estimate from a rate that other work (a message's step) or too little of the bar (under 5%) made
    buf = io.StringIO()
    with Bars(Console(file=buf, force_terminal=False)) as bars:
        bars("building (hashing)", 0, 100)
        bars.say("ranking")
        time.sleep(0.2)
        bars("building", 1, 100)
        bars("building, checked", 3, 100)
    assert buf.getvalue().splitlines() == ["building (hashing)", "ranking", "building", "building, checked"]
