"""Build a river GGUF from a base GGUF (gguf_tools/FORMAT.md), and rewrite its river.* keys."""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFValueType as V
from gguf.quants import dequantize

import river_edge
from river_edge import format as F
from river_edge.format import RiverError
from river_edge.progress import Progress

from . import quant
from .reader import ggml_shape, n_dims, n_vocab_of, open_gguf, value
from .writer import Tensor, arch_of, check_dst, copy, kv_of, write

_INT = {T.I8, T.I16, T.I32, T.I64, T.F64}


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def to_f32(data: np.ndarray, qtype: T, name: str = "") -> np.ndarray:
    """A tensor's values as float32 (numpy shape, ne0 last), by gguf-py's dequantizer."""
    try:
        return np.asarray(dequantize(data, qtype), dtype=np.float32)
    except NotImplementedError:
        raise RiverError(f"tensor {name}: gguf-py cannot dequantize type {qtype.name}") from None


def _f16(x: np.ndarray, name: str) -> np.ndarray:
    y = x.astype(np.float16)
    if not np.isfinite(y).all():
        raise RiverError(f"tensor {name} has values outside the float16 range (or NaN): use backbone 'keep'")
    return y


def _convert(t, backbone: str) -> Tensor:
    """A source tensor as the backbone keeps it: FORMAT.md's keep / f16 / q8_0."""
    shape, qt = ggml_shape(t), t.tensor_type
    keep = Tensor(t.name, shape, qt, lambda: t.data)
    if backbone == "keep" or n_dims(shape) < 2 or qt in _INT:
        return keep
    target = T.F16
    if backbone == "q8_0" and quant.fits(T.Q8_0, shape[0]):
        target = T.Q8_0
    if qt == target:
        return keep  # re-quantizing Q8_0 would drift; F16 is already exact
    if target == T.F16:
        return Tensor(t.name, shape, T.F16, lambda: _f16(to_f32(t.data, qt, t.name), t.name))
    return Tensor(t.name, shape, T.Q8_0, lambda: quant.quantize(to_f32(t.data, qt, t.name), T.Q8_0))


def _importance(v: np.ndarray, what: str) -> np.ndarray:
    """Importance as quantize() takes it: NaN or inf would make every river weight NaN, all zeros every one
    zero (ggml's weighted rounding then has nothing to weigh), and a negative weight rewards error."""
    if not np.isfinite(v).all():
        raise RiverError(f"{what}: values that are not finite (NaN or inf)")
    if (v < 0).any():
        raise RiverError(f"{what}: negative values (importance is a mean of squares, >= 0)")
    if not v.any():
        raise RiverError(f"{what}: all zero")
    return v


def _imatrix_entry(path, name: str, sums, counts) -> np.ndarray:
    """One llama-imatrix entry: in_sum2 (ggml shape [n_per_row, n_mat]) over counts ([1, n_mat]), checked."""
    what = f"{path}: importance matrix for {name}"
    if sums.tensor_type != T.F32 or counts.tensor_type != T.F32:
        raise RiverError(f"{what}: in_sum2 / counts are {sums.tensor_type.name} / {counts.tensor_type.name}, not F32")
    s, n_counts = ggml_shape(sums), math.prod(ggml_shape(counts))
    n_mat = math.prod(s[1:])
    if n_dims(s) > 2:
        raise RiverError(f"{what}: in_sum2 has {n_dims(s)} dimensions, not 2 (columns x matrices)")
    if n_counts != n_mat:
        raise RiverError(f"{what}: in_sum2 of shape {list(s)} and {n_counts} counts do not match "
                         "(one count per matrix)")
    if n_mat != 1:   # expert tensors; llama and qwen2 weights are one matrix each
        raise RiverError(f"{what}: {n_mat} matrices; a dense weight has one")
    count = float(np.asarray(counts.data, dtype=np.float32).reshape(-1)[0])
    if not 0 < count < math.inf:
        raise RiverError(f"{what}: count {count:g} is not a positive number (no activations recorded)")
    return _importance(np.asarray(sums.data, dtype=np.float32).reshape(-1) / np.float32(count), what)


def load_imatrix(imatrix: Mapping[str, np.ndarray] | str | Path) -> tuple[dict[str, np.ndarray], str]:
    """({backbone tensor name: importance per input column}, sha256) from a dict or a llama.cpp imatrix GGUF.

    The GGUF form is what `llama-imatrix` writes: `<name>.in_sum2` (sum of squared activations) and
    `<name>.counts`; the importance is their quotient. Either form is checked (_importance) before use.
    """
    if isinstance(imatrix, Mapping):
        out = {k: _importance(np.asarray(v, dtype=np.float32).reshape(-1), f"importance matrix for {k}")
               for k, v in imatrix.items()}
        h = hashlib.sha256()
        for k in sorted(out):
            h.update(k.encode() + b"\0" + out[k].tobytes())
        return out, h.hexdigest()
    r = open_gguf(imatrix)
    tensors = {t.name: t for t in r.tensors}
    out = {}
    for name, t in tensors.items():
        if name.endswith(".in_sum2") and (c := tensors.get(name[:-8] + ".counts")) is not None:
            out[name[:-8]] = _imatrix_entry(imatrix, name[:-8], t, c)
    if not out:
        raise RiverError(f"{imatrix}: no importance matrix in it (no <name>.in_sum2 / <name>.counts tensors)")
    return out, sha256_file(imatrix)


def _layer_types(layer_types: str | Sequence[str] | None, river: str, n_layer: int) -> list[str]:
    types = [layer_types] * n_layer if isinstance(layer_types, str) else list(layer_types or [river] * n_layer)
    if len(types) != n_layer:
        raise RiverError(f"layer_types has {len(types)} entries; the model has {n_layer} layers")
    types = [str(x).lower() for x in types]
    for x in types:
        if x not in F.RIVER_TYPES:
            raise RiverError(f"unknown river type {x!r}: use one of {', '.join(F.RIVER_TYPES)}")
    return types


def _river_tensor(bt: Tensor, layer: int, weight: str, rtype: str, imatrix: dict[str, np.ndarray],
                  im_src: str = "") -> Tensor:
    n_per_row = bt.shape[0]
    qt = quant.type_for_row(quant.ggml_type(rtype), n_per_row)
    if not quant.fits(qt, n_per_row):
        raise RiverError(f"river type {rtype} cannot hold {bt.name}: rows of {n_per_row} are not a multiple of {GGML_QUANT_SIZES[qt][0]}")
    im = imatrix.get(bt.name)
    if im is not None and im.size != n_per_row:
        raise RiverError(f"{im_src}importance matrix for {bt.name} has {im.size} values; "
                         f"the tensor has rows of {n_per_row}")
    # From the backbone as converted (what the runtime's backbone holds), not from the source.
    return Tensor(F.river_tensor(layer, weight), bt.shape, qt,
                   lambda: quant.quantize(to_f32(bt.data(), bt.qtype, bt.name), qt, im))


def _river_kv(river: str, types: list[str], backbone: str, source_sha: str, imatrix_sha: str,
              ranking: Sequence[int] | None) -> list[tuple]:
    n = len(types)
    rank = [] if ranking is None else [(F.KEY_HEAD_RANKING, list(ranking), V.ARRAY, V.INT32)]
    return rank + [
        (F.KEY_VERSION, F.FORMAT_VERSION, V.UINT32, None),
        (F.KEY_TYPE, river, V.STRING, None),
        (F.KEY_LAYER_TYPES, types, V.ARRAY, V.STRING),
        (F.KEY_BACKBONE_TYPE, backbone, V.STRING, None),
        (F.KEY_THRESHOLDS, [math.inf] * n, V.ARRAY, V.FLOAT32),
        (F.KEY_MIN_EXIT, min(F.DEFAULT_MIN_EXIT_LAYER, n - 1), V.UINT32, None),   # 0..L-1: a 1-layer model's is 0
        (F.KEY_CALIBRATED, False, V.BOOL, None),
        (F.KEY_FIT_SUMMARY, "", V.STRING, None),
        (F.KEY_SOURCE_SHA, source_sha, V.STRING, None),
        (F.KEY_TOOL_VERSION, river_edge.__version__, V.STRING, None),
        (F.KEY_IMATRIX_SHA, imatrix_sha, V.STRING, None),
    ]


def build_river(src: str | Path, dst: str | Path, backbone: str = "f16", river: str = "q4_0",
                layer_types: str | Sequence[str] | None = None,
                imatrix: Mapping[str, np.ndarray] | str | Path | None = None,
                head: str = F.DEFAULT_HEAD_TYPE,
                ranking: Sequence[int] | Callable[[], Sequence[int]] | None = None,
                progress: Progress | None = None) -> Path:
    """Write a river GGUF at `dst` from the base GGUF `src` (never modified); returns `dst`.

    `backbone`: keep | f16 | q8_0. `river`: the default river type; `layer_types` one type per layer
    (overrides `river`). `imatrix`: {backbone tensor name: float32[n_per_row]} or a llama-imatrix GGUF.
    k-quant river types fall back per tensor as llama-quantize does when rows are not a multiple of 256.
    `head`: type of the river LM head (river.output.weight, used only for all-river drafting), or "none".
    `ranking`: the head drafter's vocabulary ranking (runtime/headrank.py), stored as river.head_ranking; or a
    function giving it, called once the arguments and the source are checked (ranking runs the model for seconds).
    """
    src, dst = Path(src), Path(dst)
    if backbone not in F.BACKBONE_TYPES:
        raise RiverError(f"unknown backbone type {backbone!r}: use one of {', '.join(F.BACKBONE_TYPES)}")
    check_dst(src, dst, same_ok=False)
    r = open_gguf(src)
    arch, n_layer = arch_of(r, src)
    if any(t.name.startswith("river.") for t in r.tensors) or F.KEY_VERSION in r.fields:
        raise RiverError(f"{src}: already a river GGUF; build from the base model")
    split = value(r, "split.count")
    if split is not None and not (isinstance(split, int) and not isinstance(split, bool)):
        raise RiverError(f"{src}: split.count {split!r} is not a whole number")
    if (split or 1) > 1:
        raise RiverError(f"{src}: split GGUFs are not supported; merge the parts first (llama-gguf-split --merge)")
    river = river.lower()
    _layer_types(river, river, 1)  # the default type must be a river type too
    types = _layer_types(layer_types, river, n_layer)
    head = head.lower()
    if head not in F.HEAD_TYPES:
        raise RiverError(f"unknown head type {head!r}: use one of {', '.join(F.HEAD_TYPES)}")
    im, im_sha = load_imatrix(imatrix) if imatrix is not None else ({}, "")
    im_src = "" if imatrix is None or isinstance(imatrix, Mapping) else f"{imatrix}: "

    backbone_tensors = [_convert(t, backbone) for t in r.tensors]
    by_name = {t.name: t for t in backbone_tensors}
    river_tensors = []
    for i in range(n_layer):
        for w in F.LAYER_WEIGHTS:
            bt = by_name.get(F.backbone_tensor(i, w))
            if bt is None:
                raise RiverError(f"{src}: tensor {F.backbone_tensor(i, w)} is missing")
            river_tensors.append(_river_tensor(bt, i, w, types[i], im, im_src))
    if head != "none":
        bt = by_name.get(F.head_source(by_name))
        if bt is None:
            raise RiverError(f"{src}: no LM head (neither output.weight nor token_embd.weight)")
        qt = quant.type_for_row(quant.ggml_type(head), bt.shape[0])
        if not quant.fits(qt, bt.shape[0]):
            raise RiverError(f"head type {head} cannot hold {bt.name}: rows of {bt.shape[0]} values")
        # from the backbone's head as converted; an imatrix names backbone tensors only, so none here
        river_tensors.append(Tensor(F.RIVER_HEAD, bt.shape, qt,
                                     lambda: quant.quantize(to_f32(bt.data(), bt.qtype, bt.name), qt)))

    kv = kv_of(r, skip={"general.architecture", "general.file_type"})
    ft = quant.FILE_TYPES[backbone] if backbone != "keep" else value(r, "general.file_type")
    if ft is not None:
        kv.insert(0, ("general.file_type", int(ft), V.UINT32, None))
    out = backbone_tensors + river_tensors
    if progress:
        progress("sha256 of the source", 0, len(out))  # seconds on a 1 GB model: say so
    if callable(ranking):
        ranking = ranking()
    if ranking is not None:
        ranking = F.check_ranking(ranking, n_vocab_of(r), "head ranking")
    kv += _river_kv(river, types, backbone, sha256_file(src), im_sha, ranking)
    write(dst, arch, kv, out, progress)
    return dst


def set_river_keys(src: str | Path, dst: str | Path, *, thresholds: Sequence[float] | None = None,
                   min_exit_layer: int | None = None, calibrated: bool | None = None,
                   fit_summary: str | None = None, gate_entropy: float | None = None,
                   gate_summary: str | None = None) -> Path:
    """Copy the river GGUF `src` to `dst` with the given river.* keys replaced (None: unchanged).

    `dst` may be `src`: the file is replaced atomically, so a reader never sees a half-written one.
    """
    src, dst = Path(src), Path(dst)
    check_dst(src, dst, same_ok=True)
    r = open_gguf(src)
    arch, n_layer = arch_of(r, src)
    if F.KEY_VERSION not in r.fields:
        raise RiverError(f"{src}: not a river GGUF (no {F.KEY_VERSION}); run river build first")
    new: dict[str, tuple] = {}
    if thresholds is not None:   # format.py's rules: the loader's and validate()'s
        new[F.KEY_THRESHOLDS] = (F.check_thresholds(list(thresholds), n_layer), V.ARRAY, V.FLOAT32)
    if min_exit_layer is not None:
        new[F.KEY_MIN_EXIT] = (F.check_min_exit_layer(min_exit_layer, n_layer), V.UINT32, None)
    if calibrated is not None:
        new[F.KEY_CALIBRATED] = (bool(calibrated), V.BOOL, None)
    if fit_summary is not None:
        new[F.KEY_FIT_SUMMARY] = (str(fit_summary), V.STRING, None)
    if gate_entropy is not None:
        new[F.KEY_GATE] = (F.check_gate(gate_entropy, "gate entropy"), V.FLOAT32, None)
    if gate_summary is not None:
        new[F.KEY_GATE_SUMMARY] = (str(gate_summary), V.STRING, None)
    return copy(src, dst, keys=new)
