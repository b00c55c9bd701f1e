"""`river eval`: task accuracy (GSM8K, MATH, HumanEval) of each configuration."""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from river_edge.format import RiverError
from river_edge.gguf_tools.writer import write_text
from river_edge.measure import evaluate as E

from .app import CacheDir, ModelArg, Threads, command, finite, gguf_for, in_cache, jsonable
from .progress import Bars

Task = Enum("Task", {t: t for t in ("gsm8k", "math", "humaneval")}, type=str)  # evaluate.TASKS


@command("eval", epilog="Examples: river eval --task gsm8k --limit 20\n\n"
                         "river eval model.river.gguf --task humaneval --configs backbone,river,exact,q4_0,q8_0")
def eval_(
    model: ModelArg = None,
    task: Annotated[Task, typer.Option("--task", case_sensitive=False, show_default=False,
                                       help="gsm8k (test_dev), math (MATH-500 dev) or humaneval.")] = ...,
    limit: Annotated[Optional[int], typer.Option(
        "--limit", min=1, show_default="all; humaneval: 80 (problems 0-79)", help="The first N problems.")] = None,
    configs: Annotated[Optional[str], typer.Option(
        "--configs", show_default="backbone,river,q4_0",
        help="Comma list: backbone, river (the GGUF's thresholds), tau=X, exact, gated, fast, or a plain "
             "file: a llama-quantize recipe of the backbone (q8_0, q4_k_m, q4_0, ...), the file river bench compares, "
             "written once beside the river GGUF.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        "--max-tokens", "-n", min=1, show_default="gsm8k 384, math 768, humaneval 512",
        help="Most tokens per answer.")] = None,
    threads: Threads = None,
    data_dir: Annotated[Optional[Path], typer.Option(
        "--data-dir", envvar="RIVER_EDGE_DATA", show_default="../shared/data beside the repository",
        help="Folder with gsm8k/test_dev.jsonl and math500/dev.jsonl.")] = None,
    # str, not Path: Path("out/") drops the separator, and run refuses it (writer.check_output)
    results: Annotated[Optional[str], typer.Option(
        "--results", metavar="PATH", show_default="river-eval/<model>.<task>.jsonl",
        help="Per-problem results (JSON lines, appended: a rerun skips finished problems); the summary goes "
             "beside it as .json (.summary.json when the results file is a .json).")] = None,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Start over: discard earlier results in that file (at the first new answer).")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.5, max=3600, callback=finite,   # evaluate.MAX_TIMEOUT
                                           help="HumanEval: seconds per program.")] = 10.0,
    cache_dir: CacheDir = None,
):
    """Task accuracy of the backbone, the river and plain quantization, greedy, side by side.

    Every problem is answered by each configuration in turn (fixed prompts through the GGUF's chat \
template), so decode speeds are measured in the same run. Prints accuracy, decode tok/s (and its ratio \
to the backbone) and mean backbone depth; writes the per-problem JSON lines and a summary JSON.
    """
    cfgs = configs.split(",") if configs is not None else None   # "" is refused, as "," is
    if cfgs is not None:
        try:
            E.check_configs(cfgs, has_river=True)  # the names; whether the model has a river comes later
        except RiverError as e:
            raise typer.BadParameter(str(e), param_hint="'--configs'") from None
    with in_cache(cache_dir):
        with Bars() as bars:
            path = gguf_for(model, bars)
            summary = E.run_eval(path, task.value, limit=limit, configs=cfgs, max_tokens=max_tokens, threads=threads,
                            data=data_dir, results=results, fresh=fresh, timeout=timeout, progress=bars)
    out = write_text(E.summary_path(Path(summary["results"])), json.dumps(jsonable(summary), indent=1) + "\n")
    typer.echo(E.format_eval(summary))
    if summary.get("sandbox"):   # what the HumanEval sandbox isolated on this host
        typer.echo(f"sandbox: {'; '.join(summary['sandbox'])}")
    typer.echo(f"\nresults {summary['results']}\nsummary {out}")
