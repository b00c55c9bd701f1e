"""`river serve`: llama-cpp-python's OpenAI-compatible server over a river GGUF, every mode per request."""
from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from river_edge import format as F

from .app import CacheDir, Ctx, Mode, ModelArg, Threads, command, gguf_for, in_cache, rule, setting
from .progress import Bars


def _name(value):
    from river_edge.serve import check_name   # the server's own rule; imported late, as the server is

    return rule(check_name)(value)


def _origins(values):
    from river_edge.serve import check_origin

    return [rule(check_origin)(v) for v in values or []]


@command("serve", epilog="Examples: river serve --port 8000   (then any OpenAI client: base_url "
                          "http://127.0.0.1:8000/v1, model 'smollm2-135m.river:exact')\n\n"
                          "river serve model.river.gguf --mode gated --name mymodel")
def serve_command(
    model: ModelArg = None,
    mode: Annotated[Optional[Mode], setting(
        "mode", "--mode", case_sensitive=False,
        show_default=f"{F.DEFAULT_MODE['serve']} (backbone for a GGUF without a river)",
        before="Mode of requests whose model names none; a request picks one with model NAME:MODE. ")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = 8000,
    name: Annotated[Optional[str], typer.Option("--name", show_default="the file's name without .gguf",
                                                callback=_name,
                                                help="Model name clients use (no ':').")] = None,
    allow_origin: Annotated[Optional[List[str]], typer.Option(
        "--allow-origin", callback=_origins, show_default="none: web pages on other origins are refused",
        help="Let web pages from this origin (scheme://host[:port]; '*' for any) call the server; repeatable.")] = None,
    request_seconds: Annotated[float, typer.Option(
        "--request-seconds", min=1,
        help="A completion running longer ends there, as at max_tokens: no request holds the model for ever.")] = 600,
    threads: Threads = None,
    ctx: Ctx = 4096,
    cache_dir: CacheDir = None,
):
    """OpenAI-compatible server (llama-cpp-python's own app) over a river GGUF, every mode per request.

    /v1/models lists NAME (the --mode) and NAME:exact, NAME:gated, NAME:river, NAME:fast, NAME:backbone; \
/v1/completions and /v1/chat/completions (streaming too) take any of them. Requests run one at a time.
    """
    from river_edge.serve import serve

    with in_cache(cache_dir):
        with Bars() as bars:
            path = gguf_for(model, bars)
    serve(path, host=host, port=port, name=name, mode=mode.value if mode is not None else None, n_ctx=ctx,
          threads=threads, allow_origins=tuple(allow_origin or ()), request_seconds=request_seconds,
          say=lambda msg: typer.echo(msg, err=True))
