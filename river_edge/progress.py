"""The progress callback every long step takes: (what, done, total); total 0 means a message with no count."""
from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    pass
