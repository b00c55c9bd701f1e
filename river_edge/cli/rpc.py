"""`river rpc-server`: serve this machine's CPU to another host's model (ggml's RPC backend)."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from river_edge import format as F
from river_edge.runtime.rpc import parse_endpoints, serve_rpc

from .app import command


@command("rpc-server", epilog="Example: river rpc-server --host 0.0.0.0 --port 50052   "
                              "then on the client: river chat MODEL --rpc this-host:50052 --gpu-layers 99")
def rpc_server(
    host: Annotated[str, typer.Option(help="Address to listen on. The protocol has no authentication: "
                                           "keep 127.0.0.1 unless the network is trusted.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 50052,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", min=1, max=F.MAX_THREADS, help="CPU threads to compute with.")] = None,
):
    """Serve this machine's CPU to RPC clients (llama.cpp's rpc-server) until stopped."""
    try:
        parse_endpoints(f"{host}:{port}")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="'--host'") from None
    # a taken port or a name is one line, exit 1, before it says it serves
    serve_rpc(host, port, threads, say=lambda line: typer.echo(line, err=True))
