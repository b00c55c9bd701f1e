"""`river inspect` and `river validate`: what a GGUF holds, and whether the runtime will accept it."""
from __future__ import annotations

import contextlib
import json
from typing import Annotated

import typer

from river_edge.gguf_tools.inspect import format_report, inspect_gguf, validate

from .app import command, existing, jsonable


@command(epilog="Example: river inspect model.river.gguf --json")
def inspect(
    file: Annotated[str, typer.Argument(metavar="FILE", help="A GGUF (river or base), or a prepared model's name.",
                                        show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print everything as JSON.")] = False,
):
    """What a GGUF holds: architecture, sizes, backbone and river types, thresholds, problems."""
    info = inspect_gguf(existing(file))
    if as_json:
        fit = info.get("fit_summary")
        if fit:
            with contextlib.suppress(ValueError, TypeError):   # TypeError: a key stored as another type
                info["fit_summary"] = json.loads(fit)
        typer.echo(json.dumps(jsonable(info), indent=1))
        return
    typer.echo(format_report(info))
    if info.get("fit_summary"):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            s = json.loads(info["fit_summary"])
            t, L = s["test"]["rule"], s["test"]["backbone"]["depth"]
            typer.echo(f"fit       target {s['target']['kind']} {s['target']['value']}, rule {s['rule']}: on unseen "
                       f"prompts depth {t['depth']:.2f} of {L:g}, KL {t['kl']:.4f}, top-1 {t['agreement']:.3f}")


@command("validate", epilog="Example: river validate model.river.gguf && echo ok")
def validate_command(
    file: Annotated[str, typer.Argument(metavar="FILE", help="The GGUF to check.", show_default=False)],
    base: Annotated[bool, typer.Option("--base", help="Accept a base GGUF (no river tensors).")] = False,
):
    """Check a river GGUF against the format (exit 0 when well formed, 1 with every problem listed)."""
    path = existing(file)
    problems = validate(path, require_river=not base)
    if problems:
        for p in problems:
            typer.echo(f"river: error: {p}", err=True)
        raise typer.Exit(1)
    info = inspect_gguf(path)
    kind = ("a river GGUF, " + ("calibrated" if info["calibrated"] else "uncalibrated")) if info["river"] \
        else "a base GGUF (no river)"
    typer.echo(f"{path}: ok, {kind} ({info['architecture']}, {info['n_layer']} layers)")
