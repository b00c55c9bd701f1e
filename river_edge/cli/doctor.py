"""`river doctor`: versions, the runtime build, the CPU and devices, and where each model's weights run."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from river_edge import format as F
from river_edge.doctor import report

from .app import command, existing


@command(epilog="Example: river doctor smollm2-135m   (paste the output into a bug report)")
def doctor(
    model: Annotated[Optional[str], typer.Argument(metavar="[MODEL]", show_default=False,
                                                   help="A GGUF or a prepared model's name: also show where "
                                                        "ggml placed its weights.")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", min=1, max=F.MAX_THREADS, help="Threads to load with.")] = None,
):
    """Versions, runtime build, CPU and ISA, devices, and the buffer types of a model's weights."""
    typer.echo(report(Path(existing(model)) if model else None, threads))
