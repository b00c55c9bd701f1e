"""Base GGUF -> calibrated river GGUF in one go, and the embedded default river GGUF (SmolLM2-135M).

`river build` and `river demo` use these; `chat`, `bench` and `eval` with no model argument call
`default_river()` to get a calibrated river GGUF in the cache folder, built on first use.

Progress callbacks have one shape everywhere (river_edge/progress.py): (what, done, total); total 0 means "no
count, just a message" (downloads, which zoo reports only as lines of text).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from . import format as F, zoo
from .calibration.report import calibrate_file, check_target, prompt_tokens
from .calibration.target import Settings, Target
from .format import RiverError
from .gguf_tools.build import build_river
from .gguf_tools.inspect import inspect_gguf
from .gguf_tools.reader import open_gguf, value
from .gguf_tools.writer import check_not_input, temp_beside
from .progress import Progress, no_progress
from .runtime import headrank
from .runtime.llama import RiverLlama

# What `river build` fits to unless told otherwise: a quality budget, mean KL of the next-token
# distribution against the backbone. On SmolLM2-135M with a Q4_0 river all-river costs about 0.12 and
# exits at random with half the layers about 0.05 (docs/design.md §6), so this asks for roughly that.
DEFAULT_TARGET = Target("kl", 0.05)
DEFAULT_BACKBONE = "f16"
DEFAULT_RIVER = "q4_0"


def resolve_base(name_or_path: str | os.PathLike, progress: Progress | None = None) -> Path:
    """zoo.resolve, but a zoo model river-edge cannot build a river for fails before it is downloaded."""
    name = str(name_or_path)
    spec = zoo.MODELS.get(name)
    if spec is not None and not spec.supported and not Path(name).expanduser().exists():
        raise RiverError(f"model '{name}' has architecture {spec.architecture}: river-edge builds rivers for "
                         f"{', '.join(F.ARCHITECTURES)} only")
    return zoo.resolve(name, progress)


def build_calibrated_river(src: str | Path, dst: str | Path, *, backbone: str = DEFAULT_BACKBONE,
                           river: str = DEFAULT_RIVER, layer_types: str | Sequence[str] | None = None,
                           imatrix: Mapping[str, np.ndarray] | str | Path | None = None,
                           head: str = F.DEFAULT_HEAD_TYPE, target: Target | None = DEFAULT_TARGET, settings: Settings | None = None,
                           progress: Progress | None = None) -> dict | None:
    """Build the river GGUF of base GGUF `src` and calibrate it into `dst`; returns the fit summary.

    target None: no calibration, `dst` keeps the neutral thresholds (+inf: never exits) and None is
    returned. Otherwise the uncalibrated river goes to a hidden temporary file beside `dst` (same file
    system, removed afterwards whatever happens) and only the calibrated file appears at `dst`, with
    DST.calibration.json and DST.calibration.png beside it (all three or none). `src` is never modified.
    """
    src, dst = Path(src), Path(dst)
    say = progress or no_progress
    check_not_input(src, dst)
    if dst.is_dir():
        raise RiverError(f"{dst}: is a folder; give the output file's name")
    if not dst.parent.is_dir():
        raise RiverError(f"{dst}: folder {dst.parent} does not exist")

    def built(what: str, done: int, total: int) -> None:
        say("building the river GGUF" if done else f"building the river GGUF ({what})", done, total)

    kw = dict(backbone=backbone, river=river, layer_types=layer_types, imatrix=imatrix, head=head, progress=built)
    if target is None:
        build_river(src, dst, ranking=lambda: rank_vocabulary(src, say), **kw)
        return None
    settings = settings or Settings()
    check_target(src, target)
    prompts = prompt_tokens(src, settings)   # the base's tokenizer is the river's: a bad prompt fails before the build
    tmp = temp_beside(dst, ".uncalibrated.gguf")
    try:
        took: dict[str, float] = {}

        def ranking():   # timed apart from the build's writing
            t = time.monotonic()
            r = rank_vocabulary(src, say)
            took["head_ranking"] = round(time.monotonic() - t, 2)
            return r

        t0 = time.monotonic()
        build_river(src, tmp, ranking=ranking, **kw)
        took["build_river_gguf"] = round(time.monotonic() - t0 - took.get("head_ranking", 0.0), 2)
        return calibrate_file(tmp, dst, target, settings, say, label=dst.name, prompts=prompts, seconds=took)
    finally:
        Path(tmp).unlink(missing_ok=True)


def rank_vocabulary(src: Path, say: Progress) -> np.ndarray:
    """The head drafter's ranking of the vocabulary (runtime/headrank.py: the model's own greedy answers), from the
    base model, which the backbone holds (rounded to f16 at most): stored in the river GGUF, so that head drafting
    over it starts without a sidecar."""
    say("ranking the vocabulary for head drafting", 0, 0)
    llm = RiverLlama(str(src), n_ctx=512, n_threads=os.cpu_count(), mode="backbone", verbose=False)
    try:
        return headrank.rank(llm)
    finally:
        llm.close()


def default_river_path(model: str = zoo.DEFAULT_MODEL) -> Path:
    return zoo.cache_dir() / "rivers" / f"{model}.river.gguf"


def stored_summary(path: str | Path) -> dict | None:
    """The fit summary a calibrated river GGUF carries (river.fit_summary), or None."""
    text = value(open_gguf(path), F.KEY_FIT_SUMMARY) or ""
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _usable(path: Path, model: str = zoo.DEFAULT_MODEL) -> bool:
    """A cached river GGUF from an earlier run: well formed, calibrated with today's default settings (an
    older release's fit, e.g. checked online over fewer tokens, is redone), built from today's model."""
    if not path.is_file():
        return False
    try:
        info = inspect_gguf(path)   # one read of the header
    except RiverError:
        return False
    try:
        settings = json.loads(info["fit_summary"] or "{}").get("settings")
    except ValueError:
        settings = None
    return (info["river"] and not info["problems"] and bool(info["calibrated"]) and settings == Settings().recorded()
            and info["source_sha256"] == zoo.MODELS[model].sha256)


def default_river(progress: Progress | None = None, model: str = zoo.DEFAULT_MODEL) -> Path:
    """The calibrated river GGUF of the default model (SmolLM2-135M-Instruct), or of zoo model `model`,
    in the cache folder: `<cache>/rivers/<model>.river.gguf`. Prepared, built and calibrated with the
    defaults on first use (a few minutes on 2 cores for SmolLM2; Qwen2.5-Coder-0.5B takes longer), reused
    afterwards while it is valid and made from the pinned model."""
    path = default_river_path(model)
    if _usable(path, model):
        return path
    base = zoo.default_model(progress) if model == zoo.DEFAULT_MODEL else resolve_base(model, progress)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RiverError(f"{path.parent}: cannot create the cache folder ({e.strerror or e})") from None
    build_calibrated_river(base, path, progress=progress)
    return path
