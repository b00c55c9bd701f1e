"""Calibration prompts: the packaged set (GSM8K train questions and code requests) or a user's file."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..format import RiverError


def default_prompts() -> list[str]:
    text = resources.files("river_edge").joinpath("data/calibration.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def read_prompts(path: str | Path) -> list[str]:
    """Calibration prompts from a file: JSON lines with a "prompt" field (.jsonl, or a first line that
    is a JSON object), else plain text with one prompt per line. Blank lines are skipped."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")   # a byte-order mark is not part of the first prompt
    except FileNotFoundError:
        raise RiverError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise RiverError(f"{path}: not a UTF-8 text file") from None
    except OSError as e:
        raise RiverError(f"{path}: cannot read ({e.strerror or e})") from None
    # lines end at \n only: str.splitlines would also cut at U+2028, form feeds, ... inside a prompt or a JSON string
    lines = [(i, ln.strip()) for i, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    if not lines:
        raise RiverError(f"{path}: no prompts in it")
    if path.suffix != ".jsonl" and not _json_object(lines[0][1]):
        return [ln for _, ln in lines]
    out = []
    for i, ln in lines:
        try:
            prompt = json.loads(ln)["prompt"]
        except (ValueError, KeyError, TypeError):
            raise RiverError(f"{path}:{i}: not a JSON object with a \"prompt\" field") from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise RiverError(f"{path}:{i}: \"prompt\" is not a non-empty string")
        out.append(prompt)
    return out
