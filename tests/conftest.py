"""Shared fixtures: tiny random models (base and river GGUFs), written once per test session.

tiny_llama / tiny_qwen2 are river GGUFs (f16 backbone, q4_0 river, thresholds +inf);
tiny_llama_base / tiny_qwen2_base their sources. Treat them as read-only: copy before changing.
The llama base is Q4_1 with a separate output.weight (SmolLM2 ships Q4_1); the qwen2 base is Q8_0
with tied embeddings (no output.weight, as Qwen2.5-0.5B; the 1.5B has one) and q/k/v biases. tiny_qwen3: Q8_0, tied,
no biases, per-head q/k norms (as Qwen3-0.6B).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from river_edge.gguf_tools.build import build_river
from river_edge.gguf_tools.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_llama_base(tiny_dir) -> Path:
    return write_tiny_model(tiny_dir / "tiny-llama-base.gguf", "llama", wtype="q4_1", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_base(tiny_dir) -> Path:
    return write_tiny_model(tiny_dir / "tiny-qwen2-base.gguf", "qwen2", wtype="q8_0", tie_embeddings=True, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_base(tiny_dir) -> Path:
    return write_tiny_model(tiny_dir / "tiny-qwen3-base.gguf", "qwen3", wtype="q8_0", tie_embeddings=True, seed=3)


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_base, tiny_dir) -> Path:
    return build_river(tiny_llama_base, tiny_dir / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_qwen2_base, tiny_dir) -> Path:
    return build_river(tiny_qwen2_base, tiny_dir / "tiny-qwen2.gguf")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_qwen3_base, tiny_dir) -> Path:
    return build_river(tiny_qwen3_base, tiny_dir / "tiny-qwen3.gguf")


@pytest.fixture
def runner(tmp_path, monkeypatch):
    """typer's CliRunner over an empty cache: nothing here may download a model."""
    from typer.testing import CliRunner

    from river_edge import zoo

    monkeypatch.setenv("RIVER_EDGE_CACHE", str(tmp_path / "cache"))

    def no_download(name, progress=None):
        raise AssertionError(f"test tried to download {name}")
    monkeypatch.setattr(zoo, "prepare", no_download)
    return CliRunner()


def pytest_terminal_summary(terminalreporter):
    """How much of the buffer-type matrix ran, and on what: AMX and CPU_REPACK exist only on some hosts."""
    var = [r for k in ("passed", "failed", "skipped") for r in terminalreporter.stats.get(k, [])
           if "cpu_variant-" in r.nodeid and (r.when == "call" or r.skipped)]
    if var:
        name = lambda r: r.nodeid.split("cpu_variant-", 1)[1].rstrip("]")  # noqa: E731
        terminalreporter.write_line(
            f"CPU variants: ran {', '.join(name(r) for r in var if r.passed) or 'none'}"
            + (f"; failed {', '.join(name(r) for r in var if r.failed)}" if any(r.failed for r in var) else "")
            + (f"; skipped (this CPU cannot run them) {', '.join(name(r) for r in var if r.skipped)}"
               if any(r.skipped for r in var) else ""))
    reports = [r for k in ("passed", "failed") for r in terminalreporter.stats.get(k, [])
               if r.when == "call" and "extra_bufts" in r.nodeid]
    if not reports:
        return
    from river_edge.measure.host import cpu

    on = sum("-extra_bufts" in r.nodeid for r in reports)
    failed = sum(r.failed for r in reports)
    c = cpu()
    kinds = "AMX and CPU_REPACK" if "amx_int8" in c["isa"] else "CPU_REPACK" if c["isa"] else "none known"
    terminalreporter.write_line(
        f"buffer-type matrix: {len(reports)} cases ran ({on} with extra buffer types, {len(reports) - on} without; "
        f"{failed} failed) on {c['model']}, extra types this CPU offers: {kinds}")
