"""Writing GGUFs: one tensor at a time, through a temporary file beside the destination renamed over it,
and copies of a GGUF with keys or tensors changed, dropped or added. Built on gguf-py's GGUFWriter."""
from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFValueType as V, GGUFWriter

from river_edge import format as F
from river_edge.format import RiverError
from river_edge.progress import Progress   # (tensor name, done, total): after each tensor written

from .reader import ggml_shape, open_gguf, raw_value, value

DROP = object()   # copy(): drop this key or tensor


class Tensor:
    """One tensor to write: name, ggml shape and type, and a function giving its data when written."""

    def __init__(self, name: str, shape: tuple[int, ...], qtype: T, data: Callable[[], np.ndarray]):
        self.name, self.shape, self.qtype, self.data = name, shape, qtype, data

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def arch_of(r, path: Path) -> tuple[str, int]:
    arch = value(r, "general.architecture")
    if arch not in F.ARCHITECTURES:
        raise RiverError(f"{path}: unsupported architecture '{arch}': river-edge supports {', '.join(F.ARCHITECTURES)}")
    n_layer = value(r, f"{arch}.block_count")
    if not isinstance(n_layer, int) or n_layer < 1:
        raise RiverError(f"{path}: missing or bad {arch}.block_count")
    return arch, n_layer


def kv_of(r, skip: set[str]) -> list[tuple[str, object, V, V | None]]:
    """The source's keys as GGUFWriter takes them, less gguf-py's synthetic GGUF.* header fields."""
    out = []
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in skip:
            continue
        out.append((k, *raw_value(f)))
    return out


class _Writer(GGUFWriter):
    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        # An empty array is valid GGUF that gguf-py refuses to write; carry it over all the same.
        if vtype == V.ARRAY and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type or V.UINT8) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


# Bytes of the output's name a temporary file's name starts with: with the pid, mkstemp's random part and a
# suffix it stays far below any file system's limit (255 bytes; 143 on eCryptfs), however long the output's is.
_HEAD = 64


def _cut(name: str, n: int) -> str:
    """The first n bytes of a file name, as the file system counts them."""
    return os.fsdecode(os.fsencode(name)[:n])


def temp_beside(dst: str | Path, suffix: str = ".part") -> Path:
    """A new empty hidden file beside `dst` for writing it (then os.replace: atomic on one file system).

    Its name is the start of dst's and this process's pid; temporary files of earlier writes of `dst` whose
    process is gone (a killed build leaves hundreds of MB) are removed first, a live concurrent writer's are left alone.
    """
    dst = Path(dst)
    check_output(dst)
    # ours for dst: .HEAD.PID.*, and ..HEAD.PID.* (a writer of that temporary file through its own one: a calibrated
    # build writes the uncalibrated river first; that HEAD is a byte shorter, as the name it is cut from has a dot)
    ours = re.compile(rf"\.({re.escape(_cut(dst.name, _HEAD))}|\.{re.escape(_cut(dst.name, _HEAD - 1))})\.(\d+)\.")
    for part in dst.parent.glob(".*"):
        m = ours.match(part.name)
        if m is None:
            continue
        try:
            os.kill(int(m[2]), 0)
            continue          # still running
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue          # someone else's live process; a number no pid is: not ours
        with contextlib.suppress(OSError):
            part.unlink()
    for part in dst.parent.glob(f".{glob.escape(dst.name)}.*{glob.escape(suffix)}"):   # named before pids were:
        with contextlib.suppress(OSError):                                            # stale once an hour old
            if not ours.match(part.name) and time.time() - part.stat().st_mtime > 3600:
                part.unlink()
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{_cut(dst.name, _HEAD)}.{os.getpid()}.", suffix=suffix)
    os.close(fd)
    return Path(tmp)


def _file_mode() -> int:
    """An ordinary new file's mode (mkstemp makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def replacing(dst: str | Path, suffix: str = ".part"):
    """A temporary file beside `dst` (temp_beside) to write: when the block ends without an error it replaces
    `dst`, with an ordinary file's mode; either way it is gone afterwards."""
    with replacing_together([dst], suffix) as (tmp,):
        yield tmp


def _named(e: OSError, dst: Path) -> OSError:
    """A write error that names no file (a full disk: ENOSPC) names the output it was writing, for the one-line
    error the CLI prints."""
    return e if e.filename else OSError(e.errno, f"{e.strerror or e} (writing it)", str(dst))


@contextlib.contextmanager
def replacing_together(dsts: list[str | Path], suffix: str = ".part"):
    """replacing() for outputs that must appear together (a GGUF and its reports): a temporary file for each,
    renamed in, in order, when the block ends without an error. If that is interrupted the ones already renamed
    in are removed, so a run leaves all of its outputs or none."""
    dsts, tmps, renaming = [Path(d) for d in dsts], [], False
    try:
        for d in dsts:
            tmps.append(temp_beside(d, suffix))
        yield tmps
        for t in tmps:
            os.chmod(t, _file_mode())
        renaming = True
        for t, d in zip(tmps, dsts):
            os.replace(t, d)
    except BaseException as e:
        for t, d in zip(tmps, dsts) if renaming else ():
            if not t.exists():   # renamed in by this run (a counter could miss the rename an interrupt followed)
                d.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _named(e, dsts[-1]) from None
        raise
    finally:
        for t in tmps:
            t.unlink(missing_ok=True)


def write_text(dst: str | Path, text: str) -> Path:
    """`text` into `dst` through a temporary file and a rename: a reader never sees half a report."""
    with replacing(dst, ".tmp") as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(dst)


def write(dst: Path, arch: str, kv: list[tuple], tensors: list[Tensor], progress: Progress | None) -> None:
    """Write a GGUF to a temporary file beside `dst`, then rename it over `dst` (never half a file).

    Tensor infos go out first and the data one tensor at a time, so at most one converted tensor
    (plus its float32 copy) is in memory at once.
    """
    try:
        with replacing(dst) as tmp:
            _write_gguf(tmp, arch, kv, tensors, progress)
    except OSError as e:
        raise RiverError(f"{dst}: cannot write ({e.strerror or e})") from None


def _write_gguf(tmp: Path, arch: str, kv: list[tuple], tensors: list[Tensor], progress: Progress | None) -> None:
    w = _Writer(tmp, arch)
    for key, val, vtype, sub in kv:
        if key == "general.alignment":
            w.data_alignment = int(val)
        # add_key_value, not add_string/add_array: those silently drop empty values.
        w.add_key_value(key, val, vtype, sub)
    for t in tensors:
        # numpy order with a non-uint8 dtype: GGUFWriter reverses it back to the ggml shape.
        w.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, t in enumerate(tensors):
        data = np.ascontiguousarray(t.data())
        if data.nbytes != t.nbytes:
            raise RiverError(f"tensor {t.name}: {data.nbytes} bytes of data for {t.nbytes} expected")
        w.write_tensor_data(data)
        if progress:
            progress(t.name, i + 1, len(tensors))
    w.close()


def check_output(dst: str | Path) -> Path:
    """An output path a write may rename over: absent or a regular file, in a folder that exists. A folder is
    refused, and so is a device: the rename would replace /dev/null itself. Commands check it before working."""
    if str(dst).endswith(tuple(x for x in (os.sep, os.altsep) if x)):   # Path() would drop it and write a file
        raise RiverError(f"{dst}: ends in a separator, so it names a folder; give the output file's name")
    dst = Path(dst)
    if dst.exists() and not dst.is_file():
        kind = "a folder" if dst.is_dir() else "not a regular file"
        raise RiverError(f"{dst}: {kind}; choose another output path")
    if not dst.parent.is_dir():
        raise RiverError(f"{dst}: folder {dst.parent} does not exist")
    return dst


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: one inode (symlinks, hard links) or, where one is missing, one resolved path."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    try:
        if a.exists() and b.exists() and os.path.samefile(a, b):
            return True
    except OSError:
        pass
    return a.resolve() == b.resolve()


def check_not_input(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Every writer's first check: nothing river-edge writes replaces the file it reads."""
    if same_file(src, dst):
        raise RiverError(f"{dst}: the output would overwrite the input; choose another path")


def check_dst(src: Path, dst: Path, same_ok: bool) -> None:
    if not same_ok:
        check_not_input(src, dst)
    check_output(dst)


def copy(src: str | Path, dst: str | Path, keys: dict | None = None, tensors: dict | None = None,
         arch: str | None = None, progress: Progress | None = None) -> Path:
    """Copy the GGUF `src` to `dst` (which may be `src`: replaced atomically) with keys and tensors changed.

    keys: {name: DROP | (value, GGUFValueType[, array item type])}; tensors: {name: DROP | (ggml shape, type,
    data)}; names the source lacks are added. `arch` overrides general.architecture."""
    src, dst = Path(src), Path(dst)
    check_dst(src, dst, same_ok=True)
    keys, tensors = dict(keys or {}), dict(tensors or {})
    r = open_gguf(src)
    arch = arch or value(r, "general.architecture")
    full = lambda v: (*v, None) if len(v) == 2 else tuple(v)
    kv = []
    for k, v, t, s in kv_of(r, skip={"general.architecture"}):
        new = keys.pop(k, None)
        if new is not DROP:
            kv.append((k, *full(new)) if new else (k, v, t, s))
    kv += [(k, *full(v)) for k, v in keys.items() if v is not DROP]
    out = []
    for t in r.tensors:
        new = tensors.pop(t.name, None)
        if new is not DROP:
            out.append(Tensor(t.name, *new[:2], lambda d=new[2]: d) if new else
                       Tensor(t.name, ggml_shape(t), t.tensor_type, lambda t=t: t.data))
    out += [Tensor(n, *v[:2], lambda d=v[2]: d) for n, v in tensors.items() if v is not DROP]
    write(dst, arch, kv, out, progress)
    return dst
