"""Rich progress bars on stderr for the library's progress callbacks.

The library reports in three shapes: calibration and river_edge.defaults give (what, done, total) with
total 0 for a plain message; gguf_tools' writers give (done, total, what); zoo gives a line of text.
`Bars` takes the first and adapts the others, so one display serves a whole command. When stderr is
not a terminal (a log, CI) there are no bars: each new step is one plain line instead.
"""
from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)


class Bars:
    """`with Bars() as bars: work(progress=bars)`. A new bar starts when the total changes or the count
    goes back (a new phase: building, loading, calibrating); within a phase only the text changes."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        # elapsed, then the estimate of what is left (from the bar's rate: calibration counts in units of work)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
                                 TimeRemainingColumn(), console=self.console)
        self._task: TaskID | None = None
        self._at = (0, 0)  # done, total of the current bar
        self._note: TaskID | None = None
        self._last = ""
        self._started = False
        self._step = ""
        self._task_start: tuple[float, int] | None = None   # without a terminal: when the current bar began, at what count

    def __enter__(self) -> "Bars":
        return self  # the display starts with the first report: a command that fails first draws nothing

    def __exit__(self, *exc) -> None:
        if self._started:
            self.progress.stop()

    def _start(self) -> None:
        if self.live and not self._started:
            self.progress.start()
            self._started = True

    def _line(self, text: str) -> None:
        """Without a terminal: one line per new step, never the same twice in a row."""
        if text != self._last:
            self.console.print(text, highlight=False, markup=False)
            self._last = text

    def __call__(self, what: str, done: int, total: int) -> None:
        if total <= 0:
            self.say(what)
            return
        if what == "done":  # calibration's last report
            if not self.live:
                return
            what = "calibrated"
        if not self.live:
            if self._task_start is None or total != self._at[1] or done < self._at[0]:
                self._task_start = (time.monotonic(), done)
            self._at = (done, total)
            t0, d0 = self._task_start
            if what != self._step:   # a new step: with the estimate of what is left, once the bar has a rate
                self._step = what
                # a rate from the first few units is mostly start-up: a build's first tensor after the vocabulary's
                # ranking read 293 minutes for an 85 s build. 5% of the bar first.
                left = (time.monotonic() - t0) / (done - d0) * (total - done) if done - d0 >= total / 20 else None
                self._line(what if left is None else
                           f"{what} ({done * 100 // total}%; about {int(left) // 60} min {int(left) % 60:02d} s left)")
            return
        self._start()
        if self._task is None or total != self._at[1] or done < self._at[0]:
            if self._task is not None:  # the previous phase is over
                self.progress.update(self._task, completed=self._at[1])
            self._task = self.progress.add_task(what, total=total)
        self.progress.update(self._task, description=what, completed=done)
        self._at = (done, total)

    def say(self, message: str) -> None:
        """A message with a spinner until the next one; earlier messages stay above as plain lines."""
        if not self.live:
            self._line(message)
            self._task_start = None   # other work ran: the bar's rate starts again after it
            return
        self._start()
        if self._note is not None:
            self.progress.remove_task(self._note)
            self.progress.console.print(f"  {self._last}", highlight=False, markup=False)
        self._last = message
        self._note = self.progress.add_task(message, total=None)

    def tensors(self, label: str):
        """gguf_tools' writers report each tensor by name: one bar under `label` instead."""
        return lambda what, done, total: self(label, done, total)
