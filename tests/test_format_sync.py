"""The river format is declared once for Python (river_edge/format.py); the C++ side (patches/) must name the
same keys, tensors and constants. Every river.* name and LLAMA_RIVER_* value in the series is checked here."""
from __future__ import annotations

import re
from pathlib import Path

from river_edge import format as F

PATCHES = Path(__file__).resolve().parent.parent / "patches"


def added_lines() -> str:
    return "\n".join(line[1:] for p in sorted(PATCHES.glob("*.patch"))
                     for line in p.read_text().splitlines() if line.startswith("+") and not line.startswith("+++"))


def test_every_river_name_in_the_series_is_declared_in_python():
    keys = {v for k, v in vars(F).items() if k.startswith("KEY_")}
    tensors = {F.river_tensor(0, w).replace(".0.", ".%d.").removesuffix(".weight") for w in F.LAYER_WEIGHTS}
    head = F.RIVER_HEAD.removesuffix(".weight")   # llama.cpp's tensor names drop the ".weight" suffix
    names = set(re.findall(r'"(river\.[a-z0-9_.%]+)"', added_lines()))
    assert names, "no river names found in the series"
    unknown = {n for n in names if n not in keys | tensors | {head}}
    assert not unknown, unknown
    # and the loader knows every river tensor of a layer, and the keys it must read
    assert tensors | {head} <= names
    assert {F.KEY_VERSION, F.KEY_THRESHOLDS, F.KEY_MIN_EXIT} <= names


def test_constants_agree():
    defines = dict(re.findall(r"#define\s+LLAMA_RIVER_(\w+)\s+(-?\d+)", added_lines()))
    assert int(defines.pop("FORMAT_VERSION")) == F.FORMAT_VERSION
    assert {k: int(v) for k, v in defines.items()} == {k: getattr(F, k) for k in defines}
    # one meaning per value: no sentinel equals another, and no error reads as an exit layer (>= -1) or a sentinel
    assert len(set(defines.values())) == len(defines)
    assert all(int(v) < -99 for k, v in defines.items() if k.startswith("ERR_"))


def test_every_llama_h_addition_is_in_one_patch():
    """The river's C API is declared in patch 0001 alone; the one other patch touching llama.h is batch invariance
    (0013), a llama.cpp feature of its own that is kept whole so that it can go upstream as it is."""
    touching = [p.name for p in sorted(PATCHES.glob("*.patch")) if "+++ b/include/llama.h" in p.read_text()]
    assert touching == ["0001-river-api.patch", "0013-batch-invariant-cpu.patch"], touching
    assert "river" not in (PATCHES / touching[1]).read_text().split("+++ b/include/llama.h", 1)[1].split("diff --git")[0]
