"""The patch series as a reader meets it: each header numbered within the series, and the build keyed by the code.

patches/build.py caches the runtime under the series' hash; a hash over whole files rebuilt every runtime (minutes
each, three runtimes in CI) when only a description changed."""
from __future__ import annotations

import re
import sys
from pathlib import Path

PATCHES = Path(__file__).resolve().parent.parent / "patches"
sys.path.insert(0, str(PATCHES))
import build as B  # noqa: E402  (patches/build.py: a script beside the series, not a package)


def listed() -> list[str]:
    return [line.split()[0] for line in (PATCHES / "series").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_each_header_is_numbered_within_the_series():
    names = listed()
    assert len(names) >= 18 and sorted(names) == names
    assert sorted(p.name for p in PATCHES.glob("*.patch")) == names   # no patch outside the series, none missing
    for i, name in enumerate(names, 1):
        assert name.startswith(f"{i:04d}-"), name
        lines = (PATCHES / name).read_text().splitlines()
        # git format-patch's form numbers its Subject line; ours, the first line
        title = next(x for x in lines if x.startswith("Subject: ")) if lines[0].startswith("From: ") else lines[0]
        assert re.match(rf"(Subject: \[PATCH )?{i:02d}/{len(names)}[\] ]", title), (name, title)


def test_the_build_hash_reads_the_code_not_the_description(tmp_path, monkeypatch):
    for p in PATCHES.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(B, "_HERE", tmp_path)
    before = B.series_hash([])
    first = tmp_path / listed()[0]
    text = first.read_text()
    first.write_text("A reworded description.\n\n" + text.split("\n", 1)[1])
    assert B.series_hash([]) == before
    at = text.index("\n+", text.index("diff --git"))
    first.write_text(text[:at] + "\n+// one more line" + text[at:])
    assert B.series_hash([]) != before
