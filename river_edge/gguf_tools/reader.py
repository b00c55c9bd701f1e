"""Opening GGUF files with gguf-py's reader, its exceptions turned into one-line RiverErrors."""
from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_MAGIC, GGUFReader, GGUFValueType

from river_edge.format import RiverError


class _Reader(GGUFReader):
    """gguf-py's reader with each array read in one pass: stock gguf-py makes one numpy view per element, which
    for a 151k-token vocabulary (its tokens, merges and token types) takes about 7 s per open of a Qwen GGUF.
    Numeric arrays are one view (data = [that part]); strings are memoryview slices of the map. contents() and
    raw_value read them as they read gguf-py's fields (tests/test_gguf_build.py compares the two readers)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        n, offs, parts = int(alen[0]), orig_offs + 12, [raw_itype, alen]
        sub = GGUFValueType(int(raw_itype[0]))
        if n == 0:
            return 12, parts, [], [GGUFValueType.ARRAY]
        if (np_type := self.gguf_scalar_to_np.get(sub)) is not None:
            arr = self._get(offs, np_type, n)
            return 12 + int(arr.nbytes), parts + [arr], [2], [GGUFValueType.ARRAY, sub]
        if sub != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        buf, data = memoryview(self.data), []
        for _ in range(n):
            end = offs + 8 + int.from_bytes(buf[offs:offs + 8], "little")
            parts += (buf[offs:offs + 8], buf[offs + 8:end])
            data.append(len(parts) - 1)
            offs = end
        return offs - orig_offs, parts, data, [GGUFValueType.ARRAY, sub]


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
    _check_lengths(p)
    try:
        r = _Reader(p)
    except Exception as e:  # gguf-py reads past the end of a short file as IndexError, ValueError, ...
        raise RiverError(f"{p}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None
    size = p.stat().st_size
    for t in r.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise RiverError(f"{p}: truncated GGUF (tensor {t.name} runs past the end of the file)")
    return r


# Sizes of GGUF's fixed-size value types; strings and arrays are walked.
_V = GGUFValueType
_FIXED = {_V.UINT8: 1, _V.INT8: 1, _V.UINT16: 2, _V.INT16: 2, _V.UINT32: 4, _V.INT32: 4, _V.FLOAT32: 4,
          _V.BOOL: 1, _V.UINT64: 8, _V.INT64: 8, _V.FLOAT64: 8}


def _check_lengths(p: Path) -> None:
    """Walk the header and refuse any count or length that claims more bytes than the file holds.

    gguf-py allocates what the header claims before reading it, so a 200-byte file claiming an array of
    2^40 elements would make it allocate without bound; here every claim is checked against the file size.
    """
    size = p.stat().st_size
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pos = 4

        def need(n: int, what: str) -> None:
            if n < 0 or pos + n > size:
                raise RiverError(f"{p}: truncated or corrupt GGUF ({what} claims {n} bytes at offset {pos}, "
                                 f"the file has {size})")

        def take(n: int, what: str) -> int:
            nonlocal pos
            need(n, what)
            pos += n
            return pos - n

        def u32(what: str) -> int:
            return struct.unpack_from("<I", m, take(4, what))[0]

        def u64(what: str) -> int:
            return struct.unpack_from("<Q", m, take(8, what))[0]

        def string(what: str) -> str:
            n = u64(what)
            return bytes(m[take(n, what):pos]).decode("utf-8", "replace")

        version = u32("version")
        if version and not version & 0xFFFF:   # the version's bytes swapped: written big-endian
            raise RiverError(f"{p}: a big-endian GGUF; llama.cpp (and river-edge) read little-endian ones")
        if version < 2:
            return  # GGUF v1 (32-bit counts): gguf-py refuses it with its own message
        n_tensors, n_kv = u64("tensor count"), u64("key count")
        need(n_kv * 12, f"{n_kv} keys")          # each at least a length and a type
        for _ in range(n_kv):
            key = string("a key name")
            vt = u32(f"key {key}")
            if vt == _V.ARRAY:
                st, n = u32(f"key {key}"), u64(f"key {key}")
                if st == _V.STRING:
                    need(n * 8, f"key {key} ({n} strings)")
                    for _ in range(n):   # inline: a vocabulary is 10^5 strings
                        end = pos + 8 + int.from_bytes(m[pos:pos + 8], "little") if pos + 8 <= size else size + 1
                        if end > size:
                            need(end - pos, f"key {key}")
                        pos = end
                elif st in _FIXED:
                    take(n * _FIXED[st], f"key {key} ({n} elements)")
                else:
                    raise RiverError(f"{p}: truncated or corrupt GGUF (key {key}: array of unknown type {st})")
            elif vt == _V.STRING:
                string(f"key {key}")
            elif vt in _FIXED:
                take(_FIXED[vt], f"key {key}")
            else:
                raise RiverError(f"{p}: truncated or corrupt GGUF (key {key}: unknown type {vt})")
        need(n_tensors * 24, f"{n_tensors} tensors")  # name length, n_dims, type, offset at least
        for _ in range(n_tensors):
            name = string("a tensor name")
            nd = u32(f"tensor {name}")
            if nd > 4:
                raise RiverError(f"{p}: truncated or corrupt GGUF (tensor {name} has {nd} dimensions)")
            take(8 * nd + 12, f"tensor {name}")


def n_vocab_of(r: GGUFReader) -> int:
    """The vocabulary's size: the tokenizer's token count (the LM head's rows); 0 without a tokenizer."""
    f = r.fields.get("tokenizer.ggml.tokens")
    return len(f.data) if f is not None else 0


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
