"""The files and prompts a benchmark compares: the river GGUF resolved from a model name, the backbone and plain
quantizations derived beside it (llama-quantize recipes of the F16 backbone, written once), the shipped source
file, and the packaged prompts."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from river_edge import zoo
from river_edge.format import RiverError
from river_edge.gguf_tools.convert import plain
from river_edge.gguf_tools.inspect import check, inspect_gguf
from river_edge.gguf_tools.quant import RECIPES, llama_quantize
from river_edge.gguf_tools.reader import open_gguf, value
from river_edge.gguf_tools.writer import replacing
from river_edge.progress import Progress, no_progress

PLAIN_FILES = ("q8_0", "q4_k_m", "q4_0", "shipped")  # stock files: llama-quantize recipes, and the source file itself
PLAIN_SOURCE = "llama-quantize of the backbone"   # what every report means by a plain file (plain_of)


def resolve_river(model: str | os.PathLike | None, progress: Progress | None = None) -> Path:
    """A river GGUF to benchmark: a path as given; a zoo name -> its calibrated river GGUF in the cache
    (built with the defaults on first use); None -> the default model's (SmolLM2-135M-Instruct)."""
    from river_edge.defaults import default_river

    if model is None:
        return default_river(progress)
    path = Path(model).expanduser()
    if not path.exists() and str(model) in zoo.MODELS:
        return default_river(progress, model=str(model))
    if not path.is_file():
        known = ", ".join(m for m, s in zoo.MODELS.items() if s.supported)
        raise RiverError(f"{model}: no such file or model name (models: {known})")
    check(path, require_river=True)
    return path


def stem(river_path: Path) -> str:
    name = river_path.name
    for suffix in (".river.gguf", ".gguf"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return river_path.stem


def source_model(info: dict) -> str | None:
    """The zoo model a river GGUF was built from (by the source's sha256), if any."""
    sha = info.get("source_sha256")
    return next((m.name for m in zoo.MODELS.values() if m.sha256 == sha), None) if sha else None


DERIVED = "river_edge.derived"   # a GGUF key on the files _derive writes (llama-quantize copies it from the backbone)


def _ours(dst: Path) -> bool:
    """A file _derive wrote: it sits in river-edge's cache (some written there before the mark; nothing to read), or
    it carries DERIVED."""
    if dst.resolve().is_relative_to(zoo.cache_dir().expanduser().resolve()):
        return True
    try:
        return value(open_gguf(dst), DERIVED) is not None
    except RiverError:   # not a GGUF at all
        return False


def _derive(src: Path, dst: Path, mode: str, progress: Progress) -> Path:
    """dst made from src, cached: reused while newer than its source; written atomically. `mode`: a
    llama-quantize recipe (plain files: what a user makes from the F16 backbone), or "backbone". A file at dst that
    this did not write (a user's own, named like a plain file: say the build's input) is neither used nor replaced."""
    if dst.exists() and not _ours(dst):
        raise RiverError(f"{dst}: a file river-edge did not write has the name of the {mode} file it derives from "
                         f"{src.name}; move one of them (river-edge neither uses nor replaces it)")
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with replacing(dst, ".gguf") as tmp:   # a killed run's file is removed by the next one
        progress(f"writing {dst.name}", 0, 1)
        if mode in RECIPES:
            llama_quantize(src, tmp, mode)
        else:
            plain(src, tmp, mode, lambda what, done, total: progress(f"writing {dst.name}", done, total),
                  marks={DERIVED: f"{mode} of {src.name}, by river-edge's benchmarks"})
    return dst


def prepare_files(river_path: Path, progress: Progress | None = None, plain: Sequence[str] = ("q8_0", "q4_0"),
                  shipped: bool = False, backbone: bool = False) -> tuple[dict[str, Path], dict]:
    """The files of every configuration, plain ones written once next to the river GGUF; and notes. With
    `shipped`, also the file the river was built from (the one a user already has; RiverError when it is not in
    the cache); with `backbone`, the backbone as a plain file ("plain-f16"), written only when asked or when a
    plain quantization is made from it (it is as big as the backbone)."""
    say = progress or no_progress
    river_path = Path(river_path)
    info = inspect_gguf(river_path)
    if not info["river"]:
        raise RiverError(f"{river_path}: not a river GGUF; build one with `river build`")
    source = source_model(info)
    base = zoo.model_path(source) if source and zoo.is_prepared(source) else None
    name, folder = stem(river_path), river_path.parent
    if shipped and base is None:   # checked before writing anything
        raise RiverError("shipped: the file this river GGUF was built from is not in the model cache (found only "
                         "for the offline models: `river models prepare NAME`)")
    files = {"river": river_path}
    if backbone or plain:
        files["plain-f16"] = _derive(river_path, folder / f"{name}.backbone.gguf", "backbone", say)
    for q in plain:   # llama-quantize of the F16 backbone (the shipped weights rounded to F16)
        same = q == info.get("backbone_type")   # a Q8_0 backbone is its own plain Q8_0 (no requantizing)
        files[q] = files["plain-f16"] if same else _derive(files["plain-f16"], folder / f"{name}.plain.{q}.gguf", q, say)
    if shipped:
        files["shipped"] = base   # the file the user already has: the river's source, as it was downloaded
    notes = {
        "source_model": source,
        "source_file": str(base) if base else None,
        "quant_source": PLAIN_SOURCE,
        "backbone_type": info.get("backbone_type") or "source",
        "river_type": info.get("river_type"),
        "architecture": info["architecture"],
        "n_layer": info["n_layer"],
        "calibrated": bool(info.get("calibrated")),
        "min_exit_layer": info.get("min_exit_layer"),
        "file_bytes": {k: v.stat().st_size for k, v in files.items()},
        # the backbone alone, as its own file would hold it (the river GGUF less its river tensors), written or not
        "backbone_bytes": river_path.stat().st_size - sum(int(t.n_bytes) for t in open_gguf(river_path).tensors
                                                         if t.name.startswith("river.")),
    }
    return files, notes


def plain_of(model: Path, recipe: str, progress: Progress | None = None) -> Path:
    """The plain `recipe` file of `model`, the one every table means by that name: for a river GGUF the file
    prepare_files writes beside it (llama-quantize of its backbone); for another GGUF, llama-quantize of the
    file itself (a quantized one requantized), cached under the cache folder by the file's identity."""
    model = Path(model)
    if inspect_gguf(model)["river"]:
        return prepare_files(model, progress, plain=(recipe,))[0][recipe]
    st = model.stat()
    key = hashlib.sha256(f"{model.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return _derive(model, zoo.cache_dir() / "plain" / f"{model.stem}.{key}.plain.{recipe}.gguf", recipe,
                   progress or no_progress)


def weights_note(notes: dict) -> str:
    src = zoo.MODELS[notes["source_model"]].description if notes.get("source_model") else "a user GGUF"
    return (f"source {src}; backbone {notes['backbone_type']} (an upcast where the source ships quantized); "
            f"river {notes['river_type']} re-quantized from the backbone; plain quantizations from the "
            f"{notes['quant_source']}"
            + ("" if notes.get("calibrated") else "; UNCALIBRATED river GGUF (thresholds +inf: the rule never exits)"))


def packaged_prompts(n: int) -> list[str]:
    """n packaged calibration prompts, alternating GSM8K and code (read without importing torch)."""
    rows = [json.loads(x) for x in resources.files("river_edge").joinpath("data/calibration.jsonl")
            .read_text().splitlines() if x.strip()]
    by = {}
    for r in rows:
        by.setdefault(r["source"], []).append(r["prompt"])
    groups = list(by.values())
    out, i = [], 0
    while len(out) < n and any(i < len(g) for g in groups):
        out += [g[i] for g in groups if i < len(g)]
        i += 1
    return out[:n]


def prefill_tokens(tok, n: int) -> list[int]:
    """About n tokens of packaged prompt text (BOS first), for the prefill measurement."""
    text = " ".join(packaged_prompts(40))
    ids = tok.encode(text, special=False)
    while len(ids) < n - 1:
        ids = ids + ids
    return [tok.llm.token_bos()] + ids[: n - 1]
