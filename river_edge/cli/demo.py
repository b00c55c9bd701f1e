"""`river demo` (`make demo`): the default model's river GGUF built and calibrated once, its report, a reply."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from river_edge.chat import Chat, load
from river_edge.measure import bench as B

from .app import CacheDir, Threads, command, in_cache
from .progress import Bars

DEMO_PROMPT = "In two sentences: why do small language models run well on laptops?"


@command(epilog="Example: river demo   (or: make demo)")
def demo(
    full: Annotated[bool, typer.Option(
        "--full", help="The full benchmark (`river bench`; minutes) instead of its quick form (`river bench --quick`).")] = False,
    threads: Threads = None,
    cache_dir: CacheDir = None,
):
    """The default river GGUF (SmolLM2-135M-Instruct, built once into the cache), one chat answer with its \
speed and depth, and the benchmark table (backbone vs river vs plain quantization)."""
    from river_edge.calibration.report import format_summary
    from river_edge.defaults import default_river, stored_summary

    with in_cache(cache_dir):
        with Bars() as bars:
            path = default_river(bars)
        typer.echo(f"default river GGUF: {path}")
        summary = stored_summary(path)
        if summary is not None:
            typer.echo(format_summary(summary))
        for ext in ("png", "json"):
            if Path(f"{path}.calibration.{ext}").is_file():
                typer.echo(f"report {path}.calibration.{ext}")
        typer.echo(f"\n$ river chat --prompt {DEMO_PROMPT!r} --temp 0")
        llm = load(path, threads=threads, n_ctx=1024)
        try:
            Chat(llm, out=sys.stdout, max_tokens=96, temperature=0.0).once(DEMO_PROMPT)
        finally:
            llm.close()
        typer.echo("\n$ river bench" + ("" if full else " --quick") + "   (plain quantization made once, cached)")
        kw = {} if full else dict(B.QUICK_BENCH)
        if threads is not None:
            kw["threads"] = threads
        with Bars() as bars:
            res = B.run_bench(path, progress=bars, **kw)
        typer.echo(B.format_bench(res))
