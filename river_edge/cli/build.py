"""`river build` (base GGUF -> calibrated river GGUF) and `river calibrate` (re-fit a river GGUF's thresholds)."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from river_edge import format as F
from river_edge.calibration.prompts import read_prompts
from river_edge.calibration.target import MAX_PROMPTS, MAX_TOKENS, Settings, Target
from river_edge.gguf_tools.inspect import check
from river_edge.gguf_tools.writer import check_not_input, check_output

from .app import CacheDir, base_for, command, finite, in_cache
from .progress import Bars

# Choices. Enums built from the format's own lists, so a new river type shows up here by itself.
RiverType = Enum("RiverType", {t: t for t in F.RIVER_TYPES}, type=str)
BackboneType = Enum("BackboneType", {t: t for t in F.BACKBONE_TYPES}, type=str)
HeadType = Enum("HeadType", {t: t for t in F.HEAD_TYPES}, type=str)


class Rule(str, Enum):
    per_layer = "per-layer"
    single = "single"


CAL = "Calibration"
DEFAULT_KL = 0.05  # river_edge.defaults.DEFAULT_TARGET (pinned equal by a test; importing it loads torch)


def layer_types_option(value: Optional[str]) -> Optional[str]:
    """--layer-types: a comma list of river types (checked here; split in the command)."""
    if value is not None:
        for t in value.split(","):
            if t.strip().lower() not in F.RIVER_TYPES:
                raise typer.BadParameter(f"{t.strip()!r} is not a river type (use {', '.join(F.RIVER_TYPES)})")
    return value


MaxKL = Annotated[Optional[float], typer.Option(
    "--max-kl", min=0.0, callback=finite, rich_help_panel=CAL,
    help=f"Target: mean KL of the next-token distribution vs the backbone at most X. The default "
         f"target when none is given: --max-kl {DEFAULT_KL}.")]
MinAgreement = Annotated[Optional[float], typer.Option(
    "--min-agreement", min=0.0, max=1.0, callback=finite, rich_help_panel=CAL,
    help="Target: top-1 agreement with the backbone at least X (0..1).")]
MaxDepth = Annotated[Optional[float], typer.Option(
    "--max-depth", min=1.0, callback=finite, rich_help_panel=CAL,
    help="Target (speed): mean backbone layers per decoded token at most X.")]
Prompts = Annotated[Optional[Path], typer.Option(
    "--prompts", rich_help_panel=CAL,
    help='Calibration prompts: JSON lines with a "prompt" field, or plain text, one prompt per line. '
         "Default: the packaged set (GSM8K train and code).")]
NPrompts = Annotated[int, typer.Option(
    "--n-prompts", min=2, max=MAX_PROMPTS, rich_help_panel=CAL, help="Prompts used; half fit the thresholds, half test them.")]
DecodeTokens = Annotated[int, typer.Option(
    "--decode-tokens", min=1, max=MAX_TOKENS, rich_help_panel=CAL,
    help="Greedy decode tokens per prompt whose exit signals the thresholds are fitted on.")]
OnlineTokens = Annotated[int, typer.Option(
    "--online-tokens", min=1, max=MAX_TOKENS, rich_help_panel=CAL,
    help="Tokens per prompt of the online checks (the rule writing its own K/V): the fit is tightened "
         "until it meets the target over this length, and reported on unseen prompts at it.")]
RuleOpt = Annotated[Rule, typer.Option(
    "--rule", rich_help_panel=CAL, help="per-layer thresholds, or the paper's single tau.")]


@dataclass
class Calibration:
    """The calibration options, as one value: declared once (OPTIONS) for every command that calibrates."""
    max_kl: Optional[float] = None
    min_agreement: Optional[float] = None
    max_depth: Optional[float] = None
    prompts: Optional[Path] = None
    n_prompts: int = 16
    decode_tokens: int = 32
    online_tokens: int = 256
    rule: Rule = Rule.per_layer

    def chosen(self) -> bool:
        """A target or prompts given (what --no-calibrate refuses)."""
        return any(x is not None for x in (self.max_kl, self.min_agreement, self.max_depth, self.prompts))

    def target(self):
        given = [(k, v) for k, v in (("kl", self.max_kl), ("agreement", self.min_agreement),
                                     ("depth", self.max_depth)) if v is not None]
        if len(given) > 1:
            raise typer.BadParameter("give at most one calibration target",
                                     param_hint="'--max-kl' / '--min-agreement' / '--max-depth'")
        return Target(*given[0]) if given else Target("kl", DEFAULT_KL)

    def settings(self):
        return Settings(n_prompts=self.n_prompts, decode_tokens=self.decode_tokens, online_tokens=self.online_tokens,
                        rule=self.rule.value, prompts=read_prompts(self.prompts) if self.prompts is not None else [])


OPTIONS = {"max_kl": MaxKL, "min_agreement": MinAgreement, "max_depth": MaxDepth, "prompts": Prompts,
           "n_prompts": NPrompts, "decode_tokens": DecodeTokens, "online_tokens": OnlineTokens, "rule": RuleOpt}


def calibration_options(fn):
    """Give a command the calibration options in place of its `cal: Calibration` parameter, and pass them to it as
    one Calibration (typer reads a command's options from its signature: this one is rewritten)."""
    sig = inspect.signature(fn, eval_str=True)
    params = []
    for p in sig.parameters.values():
        params += [inspect.Parameter(n, p.KEYWORD_ONLY, annotation=a, default=Calibration.__dataclass_fields__[n].default)
                   for n, a in OPTIONS.items()] if p.name == "cal" else [p.replace(kind=p.KEYWORD_ONLY)]

    @functools.wraps(fn)
    def command(**kw):
        return fn(cal=Calibration(**{n: kw.pop(n) for n in OPTIONS}), **kw)
    command.__signature__ = sig.replace(parameters=params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def report_calibration(summary: dict, out: Path) -> None:
    from river_edge.calibration.report import format_summary

    typer.echo(format_summary(summary))
    typer.echo(f"\nwrote {out}")
    for ext in ("png", "json"):
        if Path(f"{out}.calibration.{ext}").is_file():
            typer.echo(f"report {out}.calibration.{ext}")


@command(epilog="Examples: river build smollm2-135m -o smollm2.river.gguf\n\n"
                 "river build model.gguf -o model.river.gguf --backbone q8_0 --river q5_0 --min-agreement 0.9")
@calibration_options
def build(
    model: Annotated[str, typer.Argument(metavar="MODEL", show_default=False,
                                         help="Base GGUF (an architecture `river doctor` lists), or a model name from `river models`.")],
    # str, not Path: Path("new/") drops the separator, and check_output refuses it
    output: Annotated[str, typer.Option("--output", "-o", metavar="PATH", help="The river GGUF to write.",
                                        show_default=False)],
    backbone: Annotated[BackboneType, typer.Option(case_sensitive=False,
                                                   help="Backbone precision: keep the source's tensors exactly, f16 (a quantized source's "
                                                        "weights rounded to F16) or q8_0.")] = BackboneType.f16,
    river: Annotated[RiverType, typer.Option(case_sensitive=False, help="River type of every layer.")] = RiverType.q4_0,
    layer_types: Annotated[Optional[str], typer.Option(
        callback=layer_types_option, help="One river type per layer, comma separated (overrides --river), e.g. q4_0,q4_0,...,q8_0.")] = None,
    imatrix: Annotated[Optional[Path], typer.Option(
        help="Importance matrix (a llama-imatrix GGUF) weighting the river quantization.")] = None,
    head: Annotated[HeadType, typer.Option(
        case_sensitive=False, help="Type of the river's copy of the LM head, used only where every layer is river "
                                   "(drafting in exact/gated mode, fast mode); none: drafts use the backbone's head.")
    ] = HeadType(F.DEFAULT_HEAD_TYPE),
    cal: Calibration = Calibration(),
    no_calibrate: Annotated[bool, typer.Option(
        "--no-calibrate", rich_help_panel=CAL,
        help="Skip calibration: thresholds stay +inf (the river never exits) until `river calibrate`.")] = False,
    cache_dir: CacheDir = None,
):
    """Turn a base GGUF into a calibrated river GGUF in one go.

    The backbone is the source's weights (rounded to f16 by default; --backbone keep copies them) and the river is each decoder \
layer quantized to 4 bits (q4_0 by default). Calibration then fits the exit thresholds to the target \
on calibration prompts and writes its report: a table, OUT.calibration.png and OUT.calibration.json. \
The input is never modified.
    """
    types = [t.strip().lower() for t in layer_types.split(",")] if layer_types else None
    if no_calibrate and cal.chosen():
        raise typer.BadParameter("calibration options make no sense with --no-calibrate",
                                 param_hint="'--no-calibrate'")
    target, settings = (None, None) if no_calibrate else (cal.target(), cal.settings())
    from river_edge.defaults import build_calibrated_river

    with in_cache(cache_dir):
        with Bars() as bars:
            src = base_for(model, output, bars)
            summary = build_calibrated_river(src, output, backbone=backbone.value, river=river.value,
                                             layer_types=types, imatrix=imatrix, head=head.value, target=target,
                                             settings=settings, progress=bars)
    if summary is None:
        typer.echo(f"wrote {output} (uncalibrated: thresholds +inf, the river never exits; "
                   f"fit them with `river calibrate {output}`)")
    else:
        report_calibration(summary, output)


@command("calibrate", epilog="Example: river calibrate model.river.gguf --max-kl 0.02 -o model.kl002.gguf")
@calibration_options
def calibrate_command(
    river_gguf: Annotated[Path, typer.Argument(metavar="RIVER_GGUF", help="A river GGUF (from `river build`).",
                                               show_default=False)],
    # str, not Path: Path("new/") drops the separator, and check_output refuses it
    output: Annotated[Optional[str], typer.Option(
        "--output", "-o", metavar="PATH", help="Where to write the recalibrated GGUF.",
        show_default="<stem>.calibrated.gguf beside the input")] = None,
    cal: Calibration = Calibration(),
):
    """Re-fit the exit thresholds of a river GGUF to a new target, into a new file (never in place)."""
    target, settings = cal.target(), cal.settings()
    out = output if output is not None else river_gguf.with_name(f"{river_gguf.stem}.calibrated.gguf")
    from river_edge.calibration.report import calibrate_file

    check_not_input(river_gguf, out)
    check(river_gguf, require_river=True)  # before loading torch and the model
    check_output(out)
    with Bars() as bars:
        summary = calibrate_file(river_gguf, out, target, settings, bars)
    report_calibration(summary, out)
