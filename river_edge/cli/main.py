"""`river`: the command line of river-edge (typer). Thin: parsing, progress and printing; the work is
done by river_edge and river_edge.gguf_tools. One module per verb; cli/app.py holds what they share."""
from __future__ import annotations

# the verbs, in the order `river --help` lists them
from . import build, inspect, doctor, convert, models, serve, chat, bench, evaluate, demo, rpc  # noqa: F401, I001
from .app import app

__all__ = ["app"]

if __name__ == "__main__":  # python -m river_edge.cli.main
    app()
