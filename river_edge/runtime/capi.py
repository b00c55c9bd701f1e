"""The river C API of the patched llama.cpp (patches/0001, llama.h), bound through llama_cpp's own loaded library
(one copy of llama.cpp in the process); whether the loaded runtime is patched; model parameters llama-cpp-python
has no keyword for; where ggml placed a weight."""
from __future__ import annotations

import contextlib
import ctypes
import platform

import llama_cpp
import numpy as np

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.gguf_tools.reader import open_gguf

_c = ctypes
_API = {
    "llama_model_has_river": ([_c.c_void_p], _c.c_bool),
    "llama_model_tensor_buft": ([_c.c_void_p, _c.c_char_p], _c.c_char_p),
    "llama_model_river_gate": ([_c.c_void_p], _c.c_float),
    "llama_river_set_enabled": ([_c.c_void_p, _c.c_bool], None),
    "llama_river_get_enabled": ([_c.c_void_p], _c.c_bool),
    "llama_river_set_thresholds": ([_c.c_void_p, _c.POINTER(_c.c_float), _c.c_int32], _c.c_int32),
    "llama_river_get_thresholds": ([_c.c_void_p, _c.POINTER(_c.c_float), _c.c_int32], _c.c_int32),
    "llama_river_set_min_exit_layer": ([_c.c_void_p, _c.c_int32], _c.c_int32),
    "llama_river_get_min_exit_layer": ([_c.c_void_p], _c.c_int32),
    "llama_river_set_forced_exit": ([_c.c_void_p, _c.c_int32], _c.c_int32),
    "llama_river_get_forced_exit": ([_c.c_void_p], _c.c_int32),
    "llama_river_set_head": ([_c.c_void_p, _c.c_bool], _c.c_int32),
    "llama_river_get_head": ([_c.c_void_p], _c.c_int32),
    "llama_river_last_exit": ([_c.c_void_p], _c.c_int32),
    "llama_river_get_histogram": ([_c.c_void_p, _c.POINTER(_c.c_int64), _c.c_int32], _c.c_int32),
    "llama_river_get_last_scores": ([_c.c_void_p, _c.POINTER(_c.c_float), _c.c_int32], _c.c_int32),
    "llama_river_reset_stats": ([_c.c_void_p], None),
    "llama_river_decision_us": ([_c.c_void_p], _c.c_int64),
    "llama_set_batch_invariant": ([_c.c_void_p, _c.c_bool], None),   # patches/0013
    "llama_get_batch_invariant": ([_c.c_void_p], _c.c_bool),
    "llama_head_set_rows": ([_c.c_void_p, _c.POINTER(_c.c_int32), _c.c_int32], _c.c_int32),   # patches/0017
    "llama_head_get_n_rows": ([_c.c_void_p], _c.c_int32),
    "llama_head_logits": ([_c.c_void_p, _c.POINTER(_c.c_float), _c.c_int32, _c.POINTER(_c.c_float)], _c.c_int32),
}


def _lib():
    """The river C API of the loaded llama.cpp, or None for a stock (unpatched) build."""
    lib = llama_cpp.llama_cpp._lib
    if not hasattr(lib, "llama_head_logits"):  # the newest symbol: an older patched build counts as stock
        return None
    for name, (args, res) in _API.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    return lib


def runtime_is_patched() -> bool:
    return _lib() is not None


@contextlib.contextmanager
def model_params(**fields):
    """A Llama made inside loads with these llama_model_params fields set (e.g. use_extra_bufts=False):
    llama-cpp-python has no keyword for them. For stock Llama objects too (tests, benchmarks)."""
    mod = llama_cpp.llama_cpp
    default = mod.llama_model_default_params

    def params():
        p = default()
        for k, v in fields.items():
            setattr(p, k, v)
        return p

    mod.llama_model_default_params = params
    try:
        yield
    finally:
        mod.llama_model_default_params = default


def tensor_buft(llm: llama_cpp.Llama, name: str) -> str | None:
    """The ggml buffer type holding a model tensor ("CPU", "CPU_REPACK", "AMX", ...), None if no such tensor."""
    lib = _lib()
    if lib is None:
        raise RiverError("the buffer type of a tensor needs river-edge's patched llama-cpp-python")
    b = lib.llama_model_tensor_buft(llm._model.model, name.encode())
    return b.decode() if b is not None else None


# Weight types whose repacked kernels (CPU_REPACK) give a row the same bits in a verification batch as alone, as
# measured by tests/test_invariance.py on each CPU variant: on x86 Q4_0 (its gemm rows are its gemv rows) and Q4_K
# (its 4-row gemm departs, so patches/0019 runs verification batches on the gemv, several columns at a time); on ARM
# (make test-arm, four emulated CPUs) Q4_0 and Q8_0 in every layout, and Q4_K and Q5_K in their dotprod layout (8x4,
# no i8mm); Q6_K's, and the k-quants' i8mm layout (8x8), depart from 4 rows. A backbone weight held in a departing
# layout keeps exact mode on the probe's guard. macOS names ARM arm64: the same kernels, not run there.
INVARIANT_REPACK = {"x86_64": {"Q4_0", "Q4_K"}, "AMD64": {"Q4_0", "Q4_K"},
                    "aarch64": {"Q4_0", "Q8_0"}, "arm64": {"Q4_0", "Q8_0"}}
ARM_WITHOUT_I8MM = {"Q4_K", "Q5_K"}


def invariant_repack() -> set[str]:
    ok = INVARIANT_REPACK.get(platform.machine(), set())
    if platform.machine() in ("aarch64", "arm64") and \
            "MATMUL_INT8 = 1" not in llama_cpp.llama_print_system_info().decode(errors="replace"):
        ok = ok | ARM_WITHOUT_I8MM   # the loaded CPU variant has no i8mm: ggml repacks k-quants as 8x4
    return ok


def has_river_tensors(path) -> bool:
    """Whether the GGUF holds river tensors, read from the file alone (a stock runtime cannot load it: RiverLlama
    says why instead of llama.cpp's "wrong number of tensors"; `river eval` chooses its configurations)."""
    return any(t.name.startswith("river.") for t in open_gguf(path).tensors)


def offloaded_to_device(llm: llama_cpp.Llama) -> bool | None:
    """Whether the last backbone layer sits on a device (RiverLlama.offloaded); None on a stock runtime."""
    if _lib() is None:
        return None
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    buft = next(filter(None, (tensor_buft(llm, f"blk.{n_layer - 1}.{w}.weight") for w in F.LAYER_WEIGHTS)), None)
    return buft is not None and not (buft.startswith("CPU") or buft == "AMX" or buft.endswith("_Host"))


def batch_departing(llm: llama_cpp.Llama, path, n_gpu_layers: int | None) -> list[str]:
    """Why verification rows depart from one-token rows even under batch invariance (patches/0013), so that
    RiverLlama.batch_invariant is False while there are any: backbone weights whose buffer type computes a batch's
    rows with other kernels than one row's (by name); layers on a GPU or rpc-server; flash attention over 512 cells."""
    out = []
    if _lib() is not None:
        ok = invariant_repack()
        out = [t.name for t in open_gguf(path).tensors if t.name.startswith("blk.") and t.tensor_type.name not in ok
               and tensor_buft(llm, t.name) == "CPU_REPACK"]
        if n_gpu_layers and offloaded_to_device(llm):
            out.append("layers offloaded to a device")
    if llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED and llm.n_ctx() >= 512:
        # ggml's one-token flash attention splits the KV across threads from 512 cells on; a batch's rows never do
        out.append("flash attention over 512 cells or more")
    return out


def exit_histogram_of(lib, ctx, n_layer: int) -> np.ndarray:
    """counts[e + 1]: ubatches of context `ctx` that exited after layer e, e = -1..n_layer-1."""
    buf = (ctypes.c_int64 * (n_layer + 1))()
    lib.llama_river_get_histogram(ctx, buf, n_layer + 1)
    return np.array(buf, dtype=np.int64)
