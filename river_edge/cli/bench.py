"""`river bench`: the laptop benchmark, or every mode timed fairly with --mode."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.measure import bench as B, files as BF, modes as M, plots as P, records as R
from river_edge.runtime.rpc import delayed, local_servers, parse_endpoints

from .app import CacheDir, GpuLayers, check_rpc, command, finite, in_cache
from .progress import Bars


@command(epilog="Examples: river bench   (the default SmolLM2-135M river GGUF)\n\n"
                 "river bench qwen2.5-coder-0.5b --rounds 3 --out bench/results\n\n"
                 "river bench model.river.gguf --quick")
def bench(
    model: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", show_default=False,
        help="A river GGUF, or a model name from `river models` (its calibrated river GGUF is built once into "
             "the cache). Default: the SmolLM2-135M-Instruct river GGUF.")] = None,
    threads: Annotated[int, typer.Option("--threads", "-t", min=1, max=F.MAX_THREADS, help="CPU threads (decode and prefill).")] = 2,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", "-n", min=2, show_default="48 (64 with --mode); 12 with --quick", help="Greedy decode tokens per prompt.")] = None,
    rounds: Annotated[Optional[int], typer.Option(
        "--rounds", min=1, show_default="3; 1 with --quick",
        help="Rounds; each runs every configuration on every prompt, alternating.")] = None,
    max_rounds: Annotated[Optional[int], typer.Option(
        "--max-rounds", min=1, show_default="12 with --mode",
        help="With --mode: rounds are added past --rounds until every ratio's 95% interval is within +-5% of its "
             "median, up to this many.")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="A smoke run: one prompt, one round, few tokens, no memory probes (numbers are noisy).")] = False,
    mode: Annotated[Optional[str], typer.Option(
        "--mode", "-m", show_default=False,
        help="Benchmark decoding modes instead: a comma list of exact, gated, river, fast, backbone; exact with "
             "other drafters (exact:ngram prompt lookup, exact:ngram-cache, exact:river+ngram, exact:head a trimmed LM "
             "head, exact:draft a separate "
             "draft model); "
             "plain q8_0, q4_k_m, q4_0 (llama-quantize of the backbone, written beside the river GGUF) and shipped "
             "(the file the river was built from, for the offline models); sync (every layer's exit check, no exit: "
             "the cost of one decision); river:lagged (the rule decided a step late, no sync inside a step), e.g. "
             "--mode exact,exact:ngram,shipped,q8_0.")] = None,
    gpu_layers: GpuLayers = 0,
    rpc: Annotated[Optional[str], typer.Option(
        "--rpc", show_default=False,
        help="With --mode: host:port,... of `river rpc-server`s to offload --gpu-layers to; local:N starts N "
             "servers on 127.0.0.1 for the run (one thread each).")] = None,
    rpc_delay: Annotated[float, typer.Option(
        "--rpc-delay", min=0.0, callback=finite, help="With --rpc: milliseconds added each way to every message (a forwarder on "
                                     "127.0.0.1): a network's latency on one host.")] = 0.0,
    flash_attn: Annotated[bool, typer.Option(
        "--flash-attn", help="With --mode: every configuration with flash attention, under which ggml's batched "
                             "attention rounds as its one-token path does, so exact mode can speculate over "
                             "quantized backbones (`river build --backbone keep|q8_0`) as far as the start-up probe "
                             "finds batch rows exact (every size on x86, Q4_K_M included; ARM's i8mm k-quant layouts: 3 rows).")] = False,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", show_default=False,
        help="Draft model of exact:draft (a GGUF with the same vocabulary, or a model name). Default: the zoo's "
             "smaller sibling (qwen2.5-coder-0.5b for the 1.5B).")] = None,
    out: Annotated[Path, typer.Option(
        "--out", "-o", file_okay=False, help="Folder for the JSON and PNG: bench_<model>, or with --mode "
                                          "bench_modes_<model>[_gpu|_rpc[_delay<N>ms]].")] = Path("."),
    cache_dir: CacheDir = None,
):
    """Decode and prefill speed of the backbone, the river and plain quantization, measured alternately in one run.

    Configurations: backbone (river off), the backbone as a plain file, river at the calibrated thresholds, \
all-river, plain Q8_0 and Q4_0 (written once next to the river GGUF), and a forced-exit sweep drawn against \
the ideal line. Prints a table with ratios to the backbone, mean backbone depth, the share of the step \
spent deciding exits and peak memory; writes the table as JSON and a PNG.
    """
    try:
        modes = M.parse_modes(mode) if mode is not None else None
    except RiverError as e:   # a bad option value is a usage error (exit 2), as eval's --configs
        raise typer.BadParameter(str(e), param_hint="'--mode'") from None
    if not modes:   # the laptop benchmark has none of these: refused, not silently ignored
        given = [o for o, v in (("--gpu-layers", gpu_layers), ("--rpc", rpc), ("--flash-attn", flash_attn),
                                ("--draft", draft), ("--max-rounds", max_rounds)) if v]
        if given:
            raise typer.BadParameter(f"{' and '.join(given)} go{'es' if len(given) == 1 else ''} with --mode",
                                     param_hint=f"'{given[0]}'")
    if draft and "exact:draft" not in modes:   # not silently unused either (no --mode was refused above)
        raise typer.BadParameter("--draft is the draft model of exact:draft: add it to --mode", param_hint="'--draft'")
    check_rpc(rpc, gpu_layers)
    if rpc_delay and not rpc:
        raise typer.BadParameter("--rpc-delay goes with --rpc", param_hint="'--rpc-delay'")
    n_local, endpoints = 0, None
    if rpc and rpc.startswith("local:"):
        n_local = int(rpc[6:]) if rpc[6:].isdigit() else 0
        if n_local < 1:
            raise typer.BadParameter("local:N with N >= 1", param_hint="'--rpc'")
    elif rpc:
        try:
            endpoints = parse_endpoints(rpc)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="'--rpc'") from None
    kw = dict(M.QUICK_MODES if modes else B.QUICK_BENCH) if quick else {}
    if tokens is not None:
        kw["tokens"] = tokens
    if rounds is not None:
        kw["rounds"] = rounds
    if max_rounds is not None and modes:
        kw["max_rounds"] = max_rounds
    R.check_out(out)   # before the measurement, not after it
    with contextlib.ExitStack() as stack:
        stack.enter_context(in_cache(cache_dir))
        servers = stack.enter_context(local_servers(n_local)) if n_local else endpoints
        if rpc_delay:
            servers = stack.enter_context(delayed(servers, rpc_delay))
        offload = {"n_gpu_layers": gpu_layers, **({"rpc_servers": ",".join(servers)} if servers else {})}
        with Bars() as bars:
            path = BF.resolve_river(model, bars)
            res = M.run_modes(path, modes, threads=threads, draft=draft, progress=bars, flash_attn=flash_attn,
                        offload=offload if gpu_layers or rpc else None, **kw) if modes else \
                B.run_bench(path, threads=threads, progress=bars, **kw)
    if rpc_delay:
        res["offload"]["rpc_delay_ms"] = rpc_delay
    if modes:
        typer.echo(M.format_modes(res))
        where = ("_rpc" + (f"_delay{rpc_delay:g}ms" if rpc_delay else "")) if rpc else "_gpu" if gpu_layers else ""
        j, png = R.write_record(res, out, f"bench_modes_{res['model']}{where}", P.modes)
    else:
        typer.echo(B.format_bench(res))
        j, png = R.write_record(res, out, f"bench_{res['model']}", P.runtime)
    typer.echo(f"\nwrote {j}\nwrote {png}")


# -- eval ----------------------------------------------------------------------------------------------
