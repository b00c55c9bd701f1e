"""The machine and runtime a measurement ran on: what every benchmark JSON and `river doctor` record.

Speeds move a lot between hosts (AMX and the CPU_REPACK layouts change plain Q4_0/Q8_0 speeds as much as
the river's), so figures are only ever compared within one host record.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from collections import Counter
from pathlib import Path

from river_edge import __version__, format as F
from river_edge.gguf_tools.reader import open_gguf

# The ISA extensions that decide which ggml kernels run (x86 and ARM names as /proc/cpuinfo spells them).
ISA = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
       "avx512vbmi", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
       "asimd", "asimddp", "i8mm", "sve", "sve2", "sme")


def cpu() -> dict:
    """CPU model and the ISA flags of ISA it has (from /proc/cpuinfo; platform's words elsewhere)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "Hardware") and model in ("", platform.machine(), platform.processor()):
                model = val.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(val.split())
    except OSError:
        pass
    return {"model": model, "isa": [f for f in ISA if f in flags], "cpus": os.cpu_count()}


def runtime_info() -> dict:
    """llama-cpp-python's version, whether it is river-edge's patched build, and ggml's CPU feature line."""
    try:
        import llama_cpp
    except ImportError:
        return {"llama_cpp_python": None, "patched": False, "build": None, "system_info": None}
    tag = Path(llama_cpp.__file__).with_name("RIVER_BUILD")
    from river_edge.runtime.capi import runtime_is_patched

    return {"llama_cpp_python": llama_cpp.__version__, "patched": runtime_is_patched(),
            "build": tag.read_text().strip() if tag.exists() else None, "devices": devices(),
            "cpu_variant": cpu_variant(),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def cpu_variant() -> str | None:
    """The ggml CPU variant loaded in this process (a GGML_BACKEND_DL build: libggml-cpu-<variant>), or None
    when the CPU backend is built in. Read from the process's own memory map, after devices() loaded it."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        name = line.rsplit("/", 1)[-1]
        if "ggml-cpu-" in name:
            return variant_of(name)
    return None


def variant_of(filename: str) -> str:
    """libggml-cpu-haswell.so -> haswell; ARM's names have dots of their own (libggml-cpu-armv8.2_1.so)."""
    name = filename.split("ggml-cpu-", 1)[1]
    for ext in (".so", ".dll", ".dylib"):
        name = name.split(ext, 1)[0]
    return name


def devices() -> list[str]:
    """ggml's devices as 'NAME: description' (CPU, CUDA0, Vulkan0, ...), from the registry of the libggml that
    libllama uses (llama_cpp.llama_cpp._ggml, patch 0010); [] on a runtime without it."""
    import llama_cpp

    lib = getattr(llama_cpp.llama_cpp, "_ggml", None)
    if lib is None:
        return []
    llama_cpp.llama_backend_init()
    c = ctypes
    for name, args, res in (("ggml_backend_dev_count", [], c.c_size_t), ("ggml_backend_dev_get", [c.c_size_t], c.c_void_p),
                            ("ggml_backend_dev_name", [c.c_void_p], c.c_char_p),
                            ("ggml_backend_dev_description", [c.c_void_p], c.c_char_p)):
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        d = lib.ggml_backend_dev_get(i)
        out.append(f"{lib.ggml_backend_dev_name(d).decode()}: {lib.ggml_backend_dev_description(d).decode()}")
    return out


def host(threads: int | None = None) -> dict:
    """Everything a benchmark JSON names its host by: CPU model, ISA, threads, load, runtime build."""
    return {"cpu": cpu(), "threads": threads, "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "python": sys.version.split()[0], "river_edge": __version__,
            "runtime": runtime_info()}


def repacked(log: str) -> dict[str, int]:
    """The repacked layouts of a load from ggml's debug lines ("repack tensor blk.0.ffn_up.weight with q4_0_8x8"):
    {"q4_0_8x8": 7, ...}. CPU_REPACK says only that weights were repacked; ARM picks Q4_0's layout by dotprod, i8mm
    and SVE width."""
    return dict(Counter(re.findall(r"repack tensor \S+ with (\w+?_\d+x\d+)", log)).most_common())


def placement(llm) -> dict[str, dict[str, int]]:
    """Buffer types holding each kind of weight of a loaded model: {"backbone": {"AMX": 150, "CPU": 3}, ...}.
    Extra buffer types (AMX, CPU_REPACK) mean repacked layouts and their own kernels."""
    from river_edge.runtime.capi import tensor_buft

    out: dict[str, Counter] = {}
    for t in open_gguf(llm.model_path).tensors:
        if len(t.shape) < 2 or t.shape[1] == 1:
            continue  # norms and biases: not matmul weights
        role = "river head" if t.name == F.RIVER_HEAD else "river" if t.name.startswith("river.") else "backbone"
        out.setdefault(role, Counter())[tensor_buft(llm, t.name) or "?"] += 1
    return {k: dict(v.most_common()) for k, v in out.items()}

