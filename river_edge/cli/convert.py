"""`river convert`: a river GGUF to a plain GGUF (its backbone, its river, or a plain quantization)."""
from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from river_edge import format as F
from river_edge.gguf_tools.convert import plain

from .app import CacheDir, base_for, command, in_cache
from .progress import Bars

# gguf_tools.convert.CONVERSIONS (not imported here: it loads numpy and gguf; a test pins the two equal)
ConvertTo = Enum("ConvertTo", {t: t for t in ("backbone", "river", "f16", *F.RIVER_TYPES)}, type=str)


@command(epilog="Examples: river convert model.river.gguf -o backbone.gguf --to backbone\n\n"
                 "river convert smollm2-135m -o smollm2-q4_0.gguf --to q4_0")
def convert(
    model: Annotated[str, typer.Argument(metavar="MODEL", show_default=False,
                                         help="A GGUF (base or river), or a model name from `river models`.")],
    # str, not Path: Path("new/") drops the separator, and check_output refuses it
    output: Annotated[str, typer.Option("--output", "-o", metavar="PATH", help="The plain GGUF to write.",
                                        show_default=False)],
    to: Annotated[ConvertTo, typer.Option(
        "--to", case_sensitive=False, show_default=False,
        help="A quantization type (every 2-D weight, the head q6_k as llama-quantize does), or `backbone` / "
             "`river`: the model made of a river GGUF's backbone or river weights.")],
    cache_dir: CacheDir = None,
):
    """Write a plain GGUF that stock llama.cpp loads: the baselines River is compared with."""
    with in_cache(cache_dir):
        with Bars() as bars:
            src = base_for(model, output, bars)
            plain(src, output, to.value, bars.tensors(f"writing {to.value}"))
    typer.echo(f"wrote {output}")
