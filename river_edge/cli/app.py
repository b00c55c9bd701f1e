"""The `river` app and what every verb shares: errors as one line, the cache folder option, paths, the
default model argument. Each verb lives in its own module (cli/main.py lists them).

Errors: a RiverError (bad file, unsupported model, ...) prints `river: error: <message>` on stderr and
exits 1; a bad option value is a usage error (exit 2, typer's usage message); Ctrl-C exits 130, SIGTERM 143,
both after the command's cleanup (a build's temporary files) has run.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import signal
import threading
import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from river_edge import __version__, format as F, zoo
from river_edge.format import RiverError, RiverWarning
from river_edge.gguf_tools.writer import check_not_input, check_output
from river_edge.host import runtime_info
from river_edge.settings import SETTINGS

# Where ggml aborts (an rpc-server that went away mid-answer), its message line is the error; ggml would add a
# debugger's backtrace of the whole process (tens of KB). RIVER_GGML_BACKTRACE=1 keeps it, for a bug report.
if not os.environ.get("RIVER_GGML_BACKTRACE"):
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")

_show_warning = warnings.showwarning


def _warning_line(message, category, *args, **kwargs):
    """A RiverWarning is one line, as errors are; other warnings keep Python's format."""
    if issubclass(category, RiverWarning):
        typer.echo(f"river: warning: {message}", err=True)
    else:
        _show_warning(message, category, *args, **kwargs)


warnings.showwarning = _warning_line

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


# -- plumbing ------------------------------------------------------------------------------------------

def fail(message: str) -> None:
    typer.echo(f"river: error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(1)


class Terminated(BaseException):
    """SIGTERM, raised where the command is so that its `finally`s run (a build's temporary files go): Python's
    default for SIGTERM ends the process on the spot, leaving hundreds of MB beside the output."""


def _terminate(signum, frame):
    raise Terminated


def guard(fn):
    """RiverError and OS errors -> one line on stderr, exit 1; Ctrl-C -> exit 130, SIGTERM -> 143, quietly."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        main = threading.current_thread() is threading.main_thread()   # only it may set a handler
        old = signal.signal(signal.SIGTERM, _terminate) if main else None
        try:
            return fn(*args, **kwargs)
        except RiverError as e:
            fail(str(e))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except Terminated:
            raise typer.Exit(128 + signal.SIGTERM) from None
        except OSError as e:
            if e.errno == errno.EPIPE:  # `river models | head`: typer's handler exits quietly
                raise
            fail(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}")
        finally:
            if main:
                signal.signal(signal.SIGTERM, old)
    return run


def command(*args, **kwargs):
    """app.command() with the error guard."""
    def deco(fn):
        return app.command(*args, **kwargs)(guard(fn))
    return deco


@contextlib.contextmanager
def in_cache(cache_dir: Optional[Path]):
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


def finite(value: Optional[float]) -> Optional[float]:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def rule(check):
    """A callback applying one of format.py's rules (the loader's, validate()'s and the setters'): a bad value is a
    usage error with the rule's message."""
    def callback(value):
        if value is None:
            return None
        try:
            return check(value)
        except RiverError as e:
            raise typer.BadParameter(str(e)) from None
    return callback


def setting(name: str, *flags: str, before: str = "", **kw):
    """A typer option declared by its river setting (settings.py): its help (after `before`, the verb's own words),
    its default in words, and its rule as the callback where no model bound is needed (a choice of an Enum needs
    none), so a bad value is a usage error with the line the setters and the loader give."""
    s = SETTINGS[name]
    kw.setdefault("show_default", s.shown if s.shown is not None else str(s.default) if s.default is not None else True)
    return typer.Option(*flags, help=before + s.help, **kw)


def existing(name: str) -> str:
    """A path as given; a prepared zoo model's name stands for its file (nothing is downloaded). A model name that
    is not prepared is a RiverError saying how to prepare it, not "file not found"."""
    if not Path(name).expanduser().exists() and name in zoo.MODELS:
        if zoo.is_prepared(name):
            return str(zoo.model_path(name))
        raise RiverError(f"{name}: a model of `river models` that is not prepared here; "
                         f"`river models prepare {name}` downloads it")
    return name


def jsonable(x):
    """JSON without Infinity/NaN tokens (thresholds are +inf until calibrated): those become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


# -- shared options ------------------------------------------------------------------------------------

CacheDir = Annotated[Optional[Path], typer.Option(
    "--cache-dir", envvar="RIVER_EDGE_CACHE", show_default="~/.cache/river-edge",
    help="Where offline models and the default river GGUF are kept.")]
GpuLayers = Annotated[int, typer.Option(
    "--gpu-layers", help="Layers offloaded to the devices (a GPU backend, or the --rpc servers); -1: all. "
                         "bench: with --mode.")]


def check_rpc(rpc: Optional[str], gpu_layers: int) -> None:
    if rpc and not gpu_layers:   # it would connect and offload nothing
        raise typer.BadParameter("--rpc needs --gpu-layers: how many layers go to the servers (-1: all)",
                                 param_hint="'--rpc'")


def _version(value: bool):
    if value:
        rt = runtime_info()
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


def gguf_for(model: Optional[str], bars, river: bool = True) -> Path:
    """MODEL as given (a GGUF), or a zoo model's name: its river GGUF, as `river bench` takes it (built and calibrated
    into the cache once); None: the default model's. river False (a mode or drafter that needs no river): a name
    stands for the model's shipped file itself, prepared on first use, and nothing is built."""
    from river_edge.defaults import default_river

    if model is None or (not Path(model).expanduser().exists() and model in zoo.MODELS):
        name = model or zoo.DEFAULT_MODEL
        return default_river(bars, model=name) if river else zoo.prepare(name, bars)
    path = Path(model).expanduser()
    if not path.is_file():
        raise RiverError(f"{model}: no such file" + (" (a folder)" if path.is_dir() else ""))
    return path


def needs_river(mode: Optional[str], drafter: Optional[str], river: bool = True) -> bool:
    """Whether a chat in this mode needs a river GGUF: not for backbone mode, nor for exact mode with a drafter that
    drafts without one (n-gram, the head, a draft model GGUF)."""
    if not river or mode == "backbone":
        return False
    if mode == "exact" and drafter is not None:
        from river_edge.runtime.drafters import DRAFTERS   # spares `river --help` llama_cpp

        known = DRAFTERS.get(drafter.lower())
        return known.needs_river if known is not None else not drafter.endswith(".gguf")
    return True


Mode = Enum("Mode", {m: m for m in F.MODES}, type=str)
Decide = Enum("Decide", {d: d for d in F.DECISIONS}, type=str)
ModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False,
    help="A GGUF (river or plain), or a model name from `river models`: its river GGUF, built and calibrated "
         "into the cache once (its shipped file itself for backbone mode and for exact mode with a drafter that "
         "needs no river). Default: SmolLM2-135M-Instruct's.")]
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", min=1, max=F.MAX_THREADS,
                                                show_default="llama.cpp's", help="CPU threads.")]
Ctx = Annotated[int, typer.Option("--ctx", min=64, max=F.MAX_CTX, help="Context length in tokens.")]


def base_for(model: str, output: Path, bars) -> Path:
    """The base GGUF of MODEL (a path, or a zoo name prepared on first use); never the output's own file, and an
    output a write may replace (writer.check_output)."""
    from river_edge.defaults import resolve_base

    check_not_input(model, output)   # before anything is downloaded
    check_output(output)
    src = resolve_base(model, bars)
    check_not_input(src, output)
    return src
