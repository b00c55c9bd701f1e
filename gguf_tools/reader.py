"""Opening GGUF files with gguf-py's reader, its exceptions turned into one-line RiverErrors."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_MAGIC, GGUFReader, GGUFValueType

from river_edge.format import RiverError


def open_gguf(path: str | Path) -> GGUFReader:
    """GGUFReader over `path` (memory-mapped: tensor data is read only when touched)."""
    p = Path(path)
    if not p.exists():
        raise RiverError(f"{p}: file not found")
    if not p.is_file():
        raise RiverError(f"{p}: not a file")
    with open(p, "rb") as f:
        head = f.read(4)
    if len(head) < 4 or int.from_bytes(head, "little") != GGUF_MAGIC:
        raise RiverError(f"{p}: not a GGUF file (bad magic)")
    try:
        r = GGUFReader(p)
    except Exception as e:  # gguf-py reads past the end of a short file as IndexError, ValueError, ...
        raise RiverError(f"{p}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None
    size = p.stat().st_size
    for t in r.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise RiverError(f"{p}: truncated GGUF (tensor {t.name} runs past the end of the file)")
    return r


def value(r: GGUFReader, key: str, default: Any = None) -> Any:
    """A key's value as Python (str, int, float, bool, list), or `default` when absent."""
    f = r.fields.get(key)
    if f is None or not f.types:
        return default
    try:
        v = f.contents()
    except UnicodeDecodeError:
        return default
    if f.types[0] == GGUFValueType.BOOL:
        return bool(v)
    return v


def raw_value(f) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """(value, type, sub_type) of a reader field as GGUFWriter.add_key_value takes them.

    Strings stay bytes (GGUFWriter packs bytes as they are), so odd tokens survive a copy byte-exact.
    """
    t = f.types[0]
    if t == GGUFValueType.STRING:
        return bytes(f.parts[-1]), t, None
    if t == GGUFValueType.ARRAY:
        sub = GGUFValueType(int(f.parts[3][0]))  # from the file: f.types lacks it for an empty array
        if sub == GGUFValueType.ARRAY:
            raise RiverError(f"key {f.name}: nested arrays are not supported")
        if sub == GGUFValueType.STRING:
            return [bytes(f.parts[i]) for i in f.data], t, sub
        return np.concatenate([f.parts[i] for i in f.data]).tolist() if f.data else [], t, sub
    return f.parts[-1].tolist()[0], t, None


def ggml_shape(t) -> tuple[int, ...]:
    """A reader tensor's shape in ggml order (ne0 first), as the file stores it."""
    return tuple(int(d) for d in t.shape)


def n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing 1s do not count."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return n
