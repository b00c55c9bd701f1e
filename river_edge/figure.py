"""matplotlib for the figures river-edge writes (calibration's, the benchmarks'): imported only when one is drawn,
saved atomically."""
from __future__ import annotations

from pathlib import Path

from river_edge.gguf_tools.writer import replacing


def pyplot():
    """matplotlib, imported when a figure is drawn: a measurement process that imports this module (the memory
    probes among them) must not carry matplotlib in its baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path) -> Path:
    """The figure as a PNG at `path`, through a temporary file and a rename (a reader never sees half of it)."""
    with replacing(path, ".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return Path(path)
