"""Which patch series each benchmark JSON ran on: its build (host.runtime.build, patches/build.py's series hash)
matched to the commit of patches/ that hashes to it, written to bench/results/builds.json for the results pages.

    .venv/bin/python -m bench.builds     # walks git history of patches/ for builds not matched yet (`make results` runs it)

The hash covers the series, the CMake flags, Python's minor version and the compilers' --version lines, so a
commit matches only where those equal this machine's (the hosts of these records shared one image); a build no
commit matches is kept as not identified rather than guessed.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
_RESULTS = _HERE / "results"
BUILDS = _RESULTS / "builds.json"
INVARIANT = "0013-batch-invariant-cpu.patch"   # the patch the older speed tables predate
FLAGS = ([], ["-DGGML_VULKAN=ON"])   # the runtimes these records were measured with: CPU, Vulkan's (and ARM's)


def build_of(m: dict) -> str | None:
    """A record's build: the series hash its runtime carried (host.runtime.build), None where not recorded."""
    h = m.get("host") if isinstance(m.get("host"), dict) else {}
    # tests/arm/run.py's records carry the cross build's tag (patches/cross.py) at the top
    return (h.get("runtime") or {}).get("build") or (m["build"] if isinstance(m.get("build"), str) else None)


def recorded(out: Path = _RESULTS) -> set[str]:
    """Every build named by a JSON under `out`."""
    got = set()
    for p in out.rglob("*.json"):
        if p != out / BUILDS.name and isinstance(d := json.loads(p.read_text()), dict) and (b := build_of(d)):
            got.add(b)
    return got


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(_ROOT), *args], check=True, capture_output=True, text=True).stdout


def _hashes_at(commit: str) -> dict[str, list[str]]:
    """{series hash: CMake flags} of patches/ as committed at `commit`, by that commit's own build.py."""
    code = ("import json, os, sys; sys.path.insert(0, 'patches'); import build\n"
            f"got = {{build.series_hash(f): f for f in {FLAGS!r}}}\n"
            "if os.path.exists('patches/cross.py'):\n"
            "    import cross; got[cross.tag()] = ['cross: ' + cross.TRIPLE]\n"
            "print(json.dumps(got))")
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(["git", "-C", str(_ROOT), "archive", commit, "patches"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=tar.stdout, check=True)
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def identify(wanted: set[str]) -> dict[str, dict]:
    """Each wanted build's series: the oldest commit of patches/ that hashes to it, its patches and flags."""
    found: dict[str, dict] = {}
    for line in _git("log", "--format=%h %cI", "--", "patches/").splitlines():   # newest first
        commit, date = line.split()
        for h, flags in _hashes_at(commit).items():
            if h in wanted:
                series = _git("show", f"{commit}:patches/series")
                found[h] = {"commit": commit, "date": date, "cmake": flags,
                            "patches": sorted(w for w in series.split() if w.endswith(".patch"))}
    return found


def words(b: str | None, builds: dict) -> str:
    """A build in a few words: its hash, and the series it was built from where identified."""
    if not b:
        return "build not recorded"
    s = builds.get(b)
    if not s:
        return f"build {b} (series not identified)"
    p = [x[:4] for x in s["patches"]]
    before = f", before {INVARIANT[:4]}: batch invariance" if INVARIANT not in s["patches"] else ""
    return f"build {b} (the series of {s['commit']}: patches {p[0]}-{p[-1]}{before})"


def predates(b: str | None, builds: dict) -> bool:
    """Measured on a series without batch invariance (a build not identified or not recorded: not known, False)."""
    return bool(b in builds and INVARIANT not in builds[b]["patches"])


def load_builds(out: Path = _RESULTS) -> dict:
    p = out / BUILDS.name
    return json.loads(p.read_text())["builds"] if p.is_file() else {}


def main() -> int:
    wanted = recorded()
    # matches already made are kept: a shallow clone, or another image's compilers, cannot redo them
    found = {b: s for b, s in load_builds().items() if b in wanted}
    found.update(identify(wanted - set(found)))
    doc = {"how": "each build (host.runtime.build: patches/build.py's series hash) matched to the oldest commit of "
                  "patches/ that hashes to it on the machine that ran bench/builds.py; `patches` is that commit's series",
           "builds": {b: found[b] for b in sorted(found)},
           "not_identified": sorted(wanted - set(found))}
    BUILDS.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{BUILDS}: {len(found)} builds identified, {len(doc['not_identified'])} not: {doc['not_identified']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
