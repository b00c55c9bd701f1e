"""What a (river) GGUF holds, and whether it is a well-formed river GGUF (gguf_tools/FORMAT.md)."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from river_edge import format as F
from river_edge.format import RiverError

from . import quant
from .reader import ggml_shape, n_vocab_of, open_gguf, value


def _typed(r, key: str, *allowed: tuple[GGUFValueType, ...]):
    """The key's value if stored with one of the allowed GGUF types ((array, element) for arrays), None if
    absent; RiverError naming the stored type otherwise."""
    f = r.fields.get(key)
    if f is None:
        return None
    got = (GGUFValueType(int(f.types[0])),)
    if got[0] == GGUFValueType.ARRAY:
        got += (GGUFValueType(int(f.parts[3][0])),)
    if got not in allowed:
        name = lambda ts: " of ".join(t.name.lower() for t in ts)  # noqa: E731
        raise RiverError(f"{key} must be {name(allowed[0])}, not {name(got)}")
    return value(r, key)


# The stored types the loader reads (patches/0002: u32 version; f32 thresholds; u32 or i32 min exit layer; f32
# gate, kept for the gated mode): validate() reads keys through _typed with these.
KEY_TYPES = {
    F.KEY_VERSION: [(GGUFValueType.UINT32,)],
    F.KEY_THRESHOLDS: [(GGUFValueType.ARRAY, GGUFValueType.FLOAT32)],
    F.KEY_MIN_EXIT: [(GGUFValueType.UINT32,), (GGUFValueType.INT32,)],
    F.KEY_GATE: [(GGUFValueType.FLOAT32,)],
    F.KEY_HEAD_RANKING: [(GGUFValueType.ARRAY, GGUFValueType.INT32)],   # Python's alone (runtime/headrank.py)
}


def _key_problems(r, n_layer: int) -> list[str]:
    """The exit keys checked by format.py's rules (the loader's and the setters' rules)."""
    out = []
    checks = (
        (F.KEY_THRESHOLDS, lambda v, k: F.check_thresholds(v, n_layer, k)),
        (F.KEY_MIN_EXIT, lambda v, k: F.check_min_exit_layer(v, n_layer, k)),
        (F.KEY_GATE, F.check_gate),
        (F.KEY_HEAD_RANKING, lambda v, k: F.check_ranking(v, n_vocab_of(r), k)),
    )
    for key, check in checks:
        try:
            v = _typed(r, key, *KEY_TYPES[key])
            if v is not None:
                check(v, key)
        except RiverError as e:
            out.append(str(e))
    return out


def head_ranking(path: str | Path) -> np.ndarray | None:
    """The river GGUF's stored head ranking (river.head_ranking) as int32, None where it has none; RiverError naming
    the problem where it is malformed (validate()'s rule)."""
    r = open_gguf(path)
    v = _typed(r, F.KEY_HEAD_RANKING, *KEY_TYPES[F.KEY_HEAD_RANKING])
    return None if v is None else np.array(F.check_ranking(v, n_vocab_of(r), F.KEY_HEAD_RANKING), dtype=np.int32)


def n_layer_of(r, arch) -> int | None:
    """{arch}.block_count when it is a whole number the file's tensors can hold (each layer has several), else
    None: a corrupt count must not size a loop."""
    n = value(r, f"{arch}.block_count")
    ok = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= len(r.tensors)
    return n if ok else None


def _problems(r, path: Path, require_river: bool) -> list[str]:
    arch = value(r, "general.architecture")
    if arch not in F.ARCHITECTURES:
        return [f"{path}: unsupported architecture '{arch}': river-edge supports {', '.join(F.ARCHITECTURES)}"]
    n_layer = n_layer_of(r, arch)
    if n_layer is None:
        return [f"{path}: missing or bad {arch}.block_count {value(r, f'{arch}.block_count')!r} "
                f"(a count of layers its {len(r.tensors)} tensors can hold)"]
    tensors = {t.name: t for t in r.tensors}
    has_river = F.KEY_VERSION in r.fields or any(n.startswith("river.") for n in tensors)
    if not has_river:
        return [f"{path}: no river tensors (a base model? build it with `river build`)"] if require_river else []

    out: list[str] = []
    try:
        F.check_version(_typed(r, F.KEY_VERSION, *KEY_TYPES[F.KEY_VERSION]))
    except RiverError as e:
        return [f"{path}: {e}"]
    for key in (F.KEY_TYPE, F.KEY_LAYER_TYPES, F.KEY_BACKBONE_TYPE, F.KEY_THRESHOLDS, F.KEY_MIN_EXIT, F.KEY_CALIBRATED):
        if key not in r.fields:
            out.append(f"{path}: key {key} is missing")
    layer_types = value(r, F.KEY_LAYER_TYPES)
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n_layer:
            out.append(f"{path}: {F.KEY_LAYER_TYPES} has {len(layer_types) if isinstance(layer_types, list) else '?'} entries, the model {n_layer} layers")
            layer_types = None
        elif bad := [x for x in layer_types if x not in F.RIVER_TYPES]:
            out.append(f"{path}: {F.KEY_LAYER_TYPES} holds unknown river type {bad[0]!r}")
            layer_types = None
    if (rt := value(r, F.KEY_TYPE)) is not None and rt not in F.RIVER_TYPES:
        out.append(f"{path}: {F.KEY_TYPE} is unknown river type {rt!r}")
    if (bb := value(r, F.KEY_BACKBONE_TYPE)) is not None and bb not in F.BACKBONE_TYPES:
        out.append(f"{path}: {F.KEY_BACKBONE_TYPE} is unknown backbone type {bb!r}")
    out += [f"{path}: {e}" for e in _key_problems(r, n_layer)]

    expected = set()
    for i in range(n_layer):
        for w in F.LAYER_WEIGHTS:
            name, bname = F.river_tensor(i, w), F.backbone_tensor(i, w)
            expected.add(name)
            rt_, bt = tensors.get(name), tensors.get(bname)
            if bt is None:
                out.append(f"{path}: backbone tensor {bname} is missing")
            if rt_ is None:
                out.append(f"{path}: river tensor {name} is missing")
                continue
            if bt is not None and ggml_shape(rt_) != ggml_shape(bt):
                out.append(f"{path}: river tensor {name} has shape {list(ggml_shape(rt_))}, backbone {list(ggml_shape(bt))}")
            allowed = {quant.ggml_type(t) for t in F.RIVER_TYPES}
            if layer_types is not None:  # the layer's type, or llama-quantize's fallback for its rows
                lt = quant.ggml_type(layer_types[i])
                allowed = {lt, quant.type_for_row(lt, int(rt_.shape[0]))}
            if rt_.tensor_type not in allowed:
                want = "/".join(sorted(quant.type_name(t) for t in allowed))
                out.append(f"{path}: river tensor {name} has type {rt_.tensor_type.name.lower()}, expected {want}")
    if (rh := tensors.get(F.RIVER_HEAD)) is not None:
        expected.add(F.RIVER_HEAD)
        src = tensors.get(F.head_source(tensors))
        if src is not None and ggml_shape(rh) != ggml_shape(src):
            out.append(f"{path}: river tensor {F.RIVER_HEAD} has shape {list(ggml_shape(rh))}, the LM head {list(ggml_shape(src))}")
    for n in tensors:
        if n.startswith("river.") and n not in expected:
            out.append(f"{path}: unexpected river tensor {n}")
    return out


def validate(path: str | Path, require_river: bool = True) -> list[str]:
    """Every problem found, one line each (empty: a well-formed river GGUF, or base model if allowed)."""
    try:
        r = open_gguf(path)
    except RiverError as e:
        return [str(e)]
    return _problems(r, Path(path), require_river)


def check(path: str | Path, require_river: bool = True) -> None:
    """Raise RiverError naming the first problem validate() finds."""
    if problems := validate(path, require_river):
        raise RiverError(problems[0])


def inspect_gguf(path: str | Path) -> dict[str, Any]:
    """Architecture, sizes and river keys of a GGUF, plus validate()'s problems (river not required)."""
    path = Path(path)
    r = open_gguf(path)
    arch = value(r, "general.architecture")
    hp = lambda k: value(r, f"{arch}.{k}")  # noqa: E731
    info: dict[str, Any] = {
        "path": str(path), "file_bytes": path.stat().st_size, "architecture": arch, "name": value(r, "general.name"),
        "n_layer": n_layer_of(r, arch), "n_embd": hp("embedding_length"), "n_ff": hp("feed_forward_length"),
        "n_head": hp("attention.head_count"), "n_head_kv": hp("attention.head_count_kv"),
        "vocab": n_vocab_of(r) or hp("vocab_size"),
    }
    backbone = [t for t in r.tensors if not t.name.startswith("river.")]
    river = [t for t in r.tensors if t.name.startswith("river.")]
    bb_params = sum(t.n_elements for t in backbone)
    rv_params = sum(t.n_elements for t in river)
    info.update(
        n_params=bb_params,
        backbone_types=dict(Counter(t.tensor_type.name.lower() for t in backbone).most_common()),
        backbone_bytes=sum(t.n_bytes for t in backbone),
        river=bool(river) or F.KEY_VERSION in r.fields,
        river_bytes=sum(t.n_bytes for t in river),
    )
    info["backbone_bpw"] = 8 * info["backbone_bytes"] / bb_params if bb_params else 0.0
    info["river_bpw"] = 8 * info["river_bytes"] / rv_params if rv_params else 0.0
    by_layer: dict[int, set[str]] = {}
    for t in river:
        parts = t.name.split(".")   # river.blk.<i>.<weight>.weight; anything else is counted as no layer
        layer = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1
        by_layer.setdefault(layer, set()).add(quant.type_name(t.tensor_type))
    info["river_tensor_types"] = [sorted(by_layer.get(i, ())) for i in range(info["n_layer"] or 0)]
    rh = next((t for t in river if t.name == F.RIVER_HEAD), None)
    info["river_head_type"] = quant.type_name(rh.tensor_type) if rh is not None else None
    for key, name in ((F.KEY_VERSION, "format_version"), (F.KEY_TYPE, "river_type"), (F.KEY_LAYER_TYPES, "layer_types"),
                      (F.KEY_BACKBONE_TYPE, "backbone_type"), (F.KEY_THRESHOLDS, "thresholds"),
                      (F.KEY_MIN_EXIT, "min_exit_layer"), (F.KEY_CALIBRATED, "calibrated"),
                      (F.KEY_FIT_SUMMARY, "fit_summary"), (F.KEY_SOURCE_SHA, "source_sha256"),
                      (F.KEY_TOOL_VERSION, "tool_version"), (F.KEY_IMATRIX_SHA, "imatrix_sha256")):
        info[name] = value(r, key)
    info["problems"] = _problems(r, path, require_river=False)
    return info


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _counts(items) -> str:
    return ", ".join(f"{k} x{v}" for k, v in Counter(items).most_common())


def format_report(info: dict[str, Any]) -> str:
    """inspect_gguf()'s dict as a few lines of text for the terminal."""
    lines = [
        f"file      {info['path']} ({_mib(info['file_bytes'])})",
        f"model     {info['architecture']} {info['name'] or ''}: {info['n_layer']} layers, n_embd {info['n_embd']}, "
        f"n_ff {info['n_ff']}, heads {info['n_head']}/{info['n_head_kv']}, vocab {info['vocab']}, "
        f"{info['n_params'] / 1e6:.1f} M params",
        f"backbone  {info['backbone_type'] or 'source'}: {', '.join(f'{k} x{v}' for k, v in info['backbone_types'].items())}; "
        f"{_mib(info['backbone_bytes'])}, {info['backbone_bpw']:.2f} bits/weight",
    ]
    if info["river"]:
        lt = info["layer_types"] if isinstance(info["layer_types"], list) else []   # a bad type is a problem below
        lines.append(f"river     format {info['format_version']}, default {info['river_type']}, layers {_counts(lt)}; "
                     f"{_mib(info['river_bytes'])}, {info['river_bpw']:.2f} bits/weight"
                     + (f"; drafting head {info['river_head_type']}" if info["river_head_type"] else "; no drafting head"))
        th = info["thresholds"]
        if not isinstance(th, list) or not all(isinstance(x, float) for x in th):
            shown = f"unreadable ({type(th).__name__})" if th is not None else "none"
        elif th and all(math.isinf(x) and x > 0 for x in th):
            shown = "all +inf (never exits)"
        else:
            shown = " ".join(f"{x:.4g}" for x in th)
        lines.append(f"exit      min_exit_layer {info['min_exit_layer']}, calibrated {'yes' if info['calibrated'] else 'no'}, "
                     f"thresholds {shown}")
        sha, im = (x if isinstance(x, str) else repr(x) for x in (info["source_sha256"] or "?", info["imatrix_sha256"] or ""))
        lines.append(f"made by   river-edge {info['tool_version']} from sha256 {sha[:16]}..."
                     + (f", imatrix {im[:16]}..." if im else ""))
    else:
        lines.append("river     none (a base model)")
    lines += [f"problem   {p}" for p in info["problems"]]
    return "\n".join(lines)
