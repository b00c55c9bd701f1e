"""Calibration prompts: the packaged set (GSM8K train questions and code requests) or a user's file."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..format import RiverError
from .target import MAX_PROMPTS

# What a prompts file may hold: calibration uses at most target.MAX_PROMPTS prompts of at most MAX_TOKENS tokens
# (a few characters each), so more is a wrong file (/dev/zero, a data dump), refused before it fills memory.
MAX_FILE_BYTES = 16 << 20
MAX_LINE_CHARS = 1 << 20
MAX_LINES = 32 * MAX_PROMPTS   # millions of one-character lines cost a GB as strings


class Prompt(str):
    """A prompt that says where it came from (FILE:LINE), for an error that names it."""
    where = ""


def _at(text: str, where: str) -> Prompt:
    p = Prompt(text)
    p.where = where
    return p


def default_prompts() -> list[str]:
    text = resources.files("river_edge").joinpath("data/calibration.jsonl").read_text()
    return [_at(json.loads(line)["prompt"], f"packaged calibration prompt {i}")
            for i, line in enumerate(text.splitlines(), 1) if line.strip()]


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def read_prompts(path: str | Path) -> list[str]:
    """Calibration prompts from a file: JSON lines with a "prompt" field (.jsonl, or a first line that
    is a JSON object), else plain text with one prompt per line. Blank lines are skipped. Each prompt knows its
    line (Prompt.where)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)   # bounded: the path may be /dev/zero or a pipe
        if len(data) > MAX_FILE_BYTES:
            raise RiverError(f"{path}: more than {MAX_FILE_BYTES >> 20} MiB; a calibration prompts file is far smaller")
        text = data.decode("utf-8-sig")   # a byte-order mark is not part of the first prompt
    except FileNotFoundError:
        raise RiverError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise RiverError(f"{path}: not a UTF-8 text file") from None
    except OSError as e:
        raise RiverError(f"{path}: cannot read ({e.strerror or e})") from None
    if (n := text.count("\n") + (not text.endswith("\n"))) > MAX_LINES:   # counted before the lines are made
        raise RiverError(f"{path}: {n:,} lines; a calibration prompts file holds at most {MAX_LINES:,}")
    # lines end at \n only: str.splitlines would also cut at U+2028, form feeds, ... inside a prompt or a JSON string
    lines = [(i, ln.strip()) for i, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    for i, ln in lines:
        if len(ln) > MAX_LINE_CHARS:
            raise RiverError(f"{path}:{i}: a line of {len(ln):,} characters; a prompt line holds at most "
                             f"{MAX_LINE_CHARS:,}")
    if not lines:
        raise RiverError(f"{path}: no prompts in it")
    if path.suffix != ".jsonl" and not _json_object(lines[0][1]):
        return [_at(ln, f"{path}:{i}") for i, ln in lines]
    out = []
    for i, ln in lines:
        try:
            prompt = json.loads(ln)["prompt"]
        except (ValueError, KeyError, TypeError):
            raise RiverError(f"{path}:{i}: not a JSON object with a \"prompt\" field") from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise RiverError(f"{path}:{i}: \"prompt\" is not a non-empty string")
        out.append(_at(prompt, f"{path}:{i}"))
    return out
