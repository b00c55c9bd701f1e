"""Quantize float32 matrices with ggml's own quantizer (libggml-base from the installed llama_cpp).

gguf-py can quantize only a few types and its numpy code is not the one llama.cpp ships; the river
must be exactly what `llama-quantize` would make, so we call `ggml_quantize_chunk` through ctypes.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, LlamaFileType as FT
from gguf.quants import quant_shape_to_byte_shape

from river_edge.format import RiverError
from river_edge.tokenizer import quiet_llama_logs

TYPES = {
    "f16": T.F16, "bf16": T.BF16, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1,
    "q8_0": T.Q8_0, "q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K,
}
NAMES = {v: k for k, v in TYPES.items()}
# general.file_type of a model whose 2-D weights are all of one type
FILE_TYPES = {
    "f16": FT.MOSTLY_F16, "bf16": FT.MOSTLY_BF16, "q4_0": FT.MOSTLY_Q4_0, "q4_1": FT.MOSTLY_Q4_1, "q5_0": FT.MOSTLY_Q5_0,
    "q5_1": FT.MOSTLY_Q5_1, "q8_0": FT.MOSTLY_Q8_0, "q2_k": FT.MOSTLY_Q2_K, "q3_k": FT.MOSTLY_Q3_K_S,
    "q4_k": FT.MOSTLY_Q4_K_S, "q5_k": FT.MOSTLY_Q5_K_S,
    "q6_k": FT.MOSTLY_Q6_K,
}

# What llama.cpp's llama-quantize uses when a row is not a whole number of 256-wide super-blocks
# (llama_tensor_get_type); e.g. Qwen2.5-0.5B has n_embd 896.
K_FALLBACK = {T.Q2_K: T.IQ4_NL, T.Q3_K: T.IQ4_NL, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def ggml_type(name: str | T) -> T:
    if isinstance(name, T):
        return name
    try:
        return TYPES[name.lower()]
    except (KeyError, AttributeError):
        raise RiverError(f"unknown quantization type {name!r}: use one of {', '.join(TYPES)}") from None


def type_name(t: T) -> str:
    return NAMES.get(t, t.name.lower())


def fits(t: T, n_per_row: int) -> bool:
    return n_per_row % GGML_QUANT_SIZES[t][0] == 0


def type_for_row(t: T, n_per_row: int) -> T:
    """`t`, or llama.cpp's fallback for a k-quant whose rows are not a multiple of 256."""
    if not fits(t, n_per_row) and t in K_FALLBACK and fits(K_FALLBACK[t], n_per_row):
        return K_FALLBACK[t]
    return t


def _lib_path() -> Path:
    # RIVER_EDGE_GGML_BASE points at another libggml-base (a development build); normally the one
    # llama_cpp ships, so quantizer and runtime are the same code.
    if env := os.environ.get("RIVER_EDGE_GGML_BASE"):
        return Path(env)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RiverError("llama_cpp is not installed: run `make setup` (ggml's quantizer comes with it)")
    for d in spec.submodule_search_locations:
        for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
            if (p := Path(d) / "lib" / name).exists():
                return p
    raise RiverError(f"libggml-base not found under {list(spec.submodule_search_locations)}/lib")


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_lib_path()))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def quantize(x: np.ndarray, qtype: str | T, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Rows of `x` (last axis = ggml ne0) quantized to `qtype`, in gguf-py's layout.

    Quantized types come back as uint8 of shape `quant_shape_to_byte_shape(x.shape)`, f16 as float16
    of x.shape: what GGUFReader gives for a tensor of that type, and what gguf.quants.dequantize takes.
    `imatrix` (length n_per_row) weights the rounding error per column, as llama-quantize --imatrix.
    """
    t = ggml_type(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0 or x.size == 0:
        raise RiverError(f"cannot quantize an empty array of shape {x.shape}")
    n_per_row = x.shape[-1]
    nrows = x.size // n_per_row
    # ggml aborts the process on these (GGML_ASSERT), so they are checked here.
    if not fits(t, n_per_row):
        raise RiverError(f"{type_name(t)} needs rows that are a multiple of {GGML_QUANT_SIZES[t][0]}; got {n_per_row}")
    lib = _lib()
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if imatrix.size != n_per_row:
            raise RiverError(f"importance matrix has {imatrix.size} values, rows have {n_per_row}")
    elif lib.ggml_quantize_requires_imatrix(t):
        raise RiverError(f"{type_name(t)} needs an importance matrix")

    row_size = lib.ggml_row_size(t, n_per_row)
    if t == T.F16:
        out = np.empty(x.shape, dtype=np.float16)
    else:
        out = np.empty(quant_shape_to_byte_shape(x.shape, t), dtype=np.uint8)
    assert out.nbytes == row_size * nrows, "libggml-base and gguf-py disagree on the block layout"

    lib.ggml_quantize_init(t)  # once here, not racing inside the threads
    src, dst = x.ctypes.data, out.ctypes.data
    im = imatrix.ctypes.data if imatrix is not None else None

    def chunk(rows: range) -> int:
        return lib.ggml_quantize_chunk(t, src, dst, rows.start * n_per_row, len(rows), n_per_row, im)

    # ctypes drops the GIL for the call, so row chunks quantize in parallel.
    n_threads = min(os.cpu_count() or 1, 8, max(1, x.size // (1 << 18)))
    step = -(-nrows // n_threads)
    parts = [range(r, min(r + step, nrows)) for r in range(0, nrows, step)]
    if len(parts) == 1:
        written = chunk(parts[0])
    else:
        with ThreadPoolExecutor(len(parts)) as pool:
            written = sum(pool.map(chunk, parts))
    assert written == out.nbytes
    return out


# llama-quantize's recipes, by the name its command line takes: what a user makes from an F16 GGUF
RECIPES = {"q8_0": "MOSTLY_Q8_0", "q6_k": "MOSTLY_Q6_K", "q5_k_m": "MOSTLY_Q5_K_M", "q5_1": "MOSTLY_Q5_1",
           "q5_0": "MOSTLY_Q5_0", "q4_k_m": "MOSTLY_Q4_K_M", "q4_1": "MOSTLY_Q4_1", "q4_0": "MOSTLY_Q4_0",
           "q3_k_m": "MOSTLY_Q3_K_M", "q2_k": "MOSTLY_Q2_K"}


def llama_quantize(src: str | Path, dst: str | Path, recipe: str, threads: int | None = None) -> Path:
    """`llama-quantize src dst RECIPE` through llama.cpp's own API (the mixed k-quant recipes such as Q4_K_M
    are llama.cpp's per-tensor choices; nothing here re-implements them). A quantized src is requantized, as
    `llama-quantize --allow-requantize` does. The caller writes dst atomically."""
    import llama_cpp

    recipe = recipe.lower()
    if recipe not in RECIPES:
        raise RiverError(f"unknown llama-quantize recipe {recipe!r}: use one of {', '.join(RECIPES)}")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{RECIPES[recipe]}")
    p.nthread = threads or os.cpu_count() or 1
    p.allow_requantize = True   # a shipped quantized file is a user's only source; an F16 one is unaffected

    with quiet_llama_logs():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise RiverError(f"{src}: llama.cpp could not quantize it to {recipe}")
    return Path(dst)
