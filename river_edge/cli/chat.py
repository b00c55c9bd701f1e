"""`river chat`: a local chat loop in any mode, with exit depths shown per token if asked."""
from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from river_edge import format as F
from river_edge.chat import Chat, check_text, legend, load, terminal_lines
from river_edge.settings import SETTINGS

from .app import (CacheDir, Ctx, Decide, GpuLayers, Mode, ModelArg, Threads, check_rpc, command, fail, gguf_for,
                  in_cache, needs_river, rule, setting)
from .progress import Bars


@command(epilog="Examples: river chat\n\nriver chat model.river.gguf --tau 0.95 --color-depth\n\n"
                 "river chat --prompt 'What is 7 times 8?'   (one answer, then exit)\n\n"
                 "printf 'hi\\n/stats\\n' | river chat")
def chat(
    model: ModelArg = None,
    tau: Annotated[Optional[float], setting("thresholds", "--tau", callback=rule(lambda v: F.check_threshold(v, "tau")),
                                            show_default=False)] = None,
    no_river: Annotated[bool, typer.Option("--no-river", help="Run the backbone alone (no early exit).")] = False,
    mode: Annotated[Optional[Mode], setting("mode", "--mode", case_sensitive=False)] = None,
    gate: Annotated[Optional[float], setting("gate", "--gate", callback=rule(SETTINGS["gate"]))] = None,
    drafter: Annotated[Optional[str], setting("drafter", "--drafter")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt.")] = None,
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", "-p", help="Answer this one message and exit (scripts, `make demo`).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens per answer.")] = 512,
    threads: Threads = None,
    color_depth: Annotated[bool, typer.Option(
        "--color-depth", help="Colour each token by the backbone depth of the step that made it (legend shown).")] = False,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Sampling temperature (0: greedy).")] = 0.2,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    ctx: Ctx = 4096,
    decide: Annotated[Optional[Decide], setting("decide", "--decide", case_sensitive=False)] = None,
    flash_attn: Annotated[bool, typer.Option(
        "--flash-attn", help="Flash attention. From a context of 512 cells, ggml splits a lone row's attention "
                             "across threads and never a batch's, so exact mode's verification rows are no longer "
                             "bit-identical to one-token decoding: its near-tie guard decides there.")] = False,
    gpu_layers: GpuLayers = 0,
    rpc: Annotated[Optional[str], typer.Option(
        "--rpc", help="host:port,... of `river rpc-server`s to offload the --gpu-layers to.")] = None,
    cache_dir: CacheDir = None,
):
    """Chat with a GGUF in the terminal, with its own chat template, streaming the answer.

    After each answer: tokens, decode tok/s and the mean backbone depth (layers of the backbone a token \
ran before exiting to the river). In the chat: /reset clears the history, /stats shows the session's \
numbers, /quit (or Ctrl-D, Ctrl-C) leaves. Reads lines from a pipe as well as from a terminal.
    """
    if tau is not None and no_river:
        raise typer.BadParameter("--tau has no effect with --no-river", param_hint="'--tau'")
    if mode is not None and no_river:
        raise typer.BadParameter("give --mode or --no-river, not both", param_hint="'--mode'")
    if gate is not None and (mode is None or mode.value != "gated"):
        raise typer.BadParameter("--gate needs --mode gated", param_hint="'--gate'")
    if drafter is not None and (mode is None or mode.value != "exact"):
        raise typer.BadParameter("--drafter needs --mode exact", param_hint="'--drafter'")
    if decide is not None and (no_river or (mode is not None and mode.value != "river")):
        raise typer.BadParameter("--decide needs river mode (the default)", param_hint="'--decide'")
    check_rpc(rpc, gpu_layers)
    for text, what in ((system, "--system"), (prompt, "--prompt")):
        if text is not None:
            check_text(text, what)
    if hasattr(sys.stdin, "reconfigure"):   # a piped line that is not UTF-8 is refused alone, not the whole chat
        sys.stdin.reconfigure(errors="surrogateescape")
    if prompt is None and sys.stdin is None:   # started with stdin closed (`<&-`): nothing to read
        fail("standard input is closed: give --prompt TEXT, pipe lines in, or run it in a terminal")
    with in_cache(cache_dir):
        with Bars() as bars:
            path = gguf_for(model, bars, river=needs_river(mode and mode.value, drafter, not no_river))
    llm = load(path, tau=tau, river=not no_river, threads=threads, n_ctx=ctx, seed=seed,
               mode=mode.value if mode is not None else None, **({"gate": gate} if gate is not None else {}),
               **({"drafter": drafter} if drafter is not None else {}),
               **({"decide": decide.value} if decide is not None else {}), n_gpu_layers=gpu_layers,
               flash_attn=flash_attn,
               **({"rpc_servers": rpc} if rpc else {}))
    if tau is not None and not llm.has_river:
        fail(f"{path}: --tau needs a river GGUF (this one has no river)")
    session = Chat(llm, out=sys.stdout, system=system, max_tokens=max_tokens, color=color_depth,
                   temperature=temp, seed=seed)
    if prompt is not None:   # Ctrl-C here is an interrupted command: exit 130, as every verb
        if color_depth:
            typer.echo(legend(), err=True)
        session.once(prompt)
        return
    try:
        interactive = sys.stdin.isatty()
        lines = terminal_lines() if interactive else sys.stdin
        session.run(lines, interactive=interactive, err=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C: a clean exit, like EOF
        typer.echo("")


# -- bench ---------------------------------------------------------------------------------------------
