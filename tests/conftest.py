"""Shared fixtures: tiny random models (base and river GGUFs), written once per test session.

tiny_<name> are river GGUFs (f16 backbone, q4_0 river, thresholds +inf), tiny_<name>_base their sources, for
every name in TINY. Treat them as read-only: copy before changing.
The llama base is Q4_1 with a separate output.weight (SmolLM2 ships Q4_1); the qwen2 base is Q8_0
with tied embeddings (no output.weight, as Qwen2.5-0.5B; the 1.5B has one) and q/k/v biases. tiny_qwen3: Q8_0, tied,
no biases, per-head q/k norms (as Qwen3-0.6B).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from river_edge.gguf_tools.build import build_river
from river_edge.gguf_tools.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


# The tiny models, one per architecture the suite pins (tests parametrize over ARCHS by name): each is a
# fixture tiny_<name>_base (the source) and tiny_<name> (its river GGUF).
TINY = {
    "llama": dict(arch="llama", wtype="q4_1", seed=1),
    # Llama 3.x: rope_freqs (frequencies divided by 1..8) and a 500k base; Q8_0, tied, as Llama 3.2 1B
    "llama3": dict(arch="llama", wtype="q8_0", tie_embeddings=True, rope_freqs=True, seed=4),
    "qwen2": dict(arch="qwen2", wtype="q8_0", tie_embeddings=True, seed=2),
    "qwen3": dict(arch="qwen3", wtype="q8_0", tie_embeddings=True, seed=3),
    # Gemma 3: six layers, so the default pattern gives five sliding-window layers and one global; a window of
    # 8 that the tests' sequences outgrow; eight heads of 16, so n_head * head_dim (128) is not n_embd (64), and
    # one KV head. Untied, unlike the 270M: with tied embeddings and Gemma's sqrt(n_embd) scale a random model
    # writes its last token forever, and the sliding layers' scores then repeat exactly (ties everywhere). Heads of
    # 32 make the reference comparisons flaky: a Q8 rounding that flips on summation noise early in a sequence
    # reaches every later row through the cache, and longer heads make one likelier.
    "gemma3": dict(arch="gemma3", wtype="q8_0", n_layer=6, n_head=8, head_dim=16, n_head_kv=1, n_swa=8, seed=0),
    # Ministral 3: llama's graph with Llama 4's attention temperature (from position 4 here)
    "mistral3": dict(arch="mistral3", wtype="q8_0", seed=18),
}
ARCHS = tuple(TINY)


def _tiny_fixtures(name: str, spec: dict):
    @pytest.fixture(scope="session")
    def base(tiny_dir) -> Path:
        kw = dict(spec)
        return write_tiny_model(tiny_dir / f"tiny-{name}-base.gguf", kw.pop("arch"), **kw)

    @pytest.fixture(scope="session")
    def river(tiny_dir, request) -> Path:
        return build_river(request.getfixturevalue(f"tiny_{name}_base"), tiny_dir / f"tiny-{name}.gguf")
    return base, river


for _name, _spec in TINY.items():
    globals()[f"tiny_{_name}_base"], globals()[f"tiny_{_name}"] = _tiny_fixtures(_name, _spec)


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


def _skip_reason(report) -> str:
    r = report.longrepr
    why = r[2] if isinstance(r, tuple) and len(r) == 3 else str(r)
    return why.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    """The skips counted per reason (a run's 48 skips are otherwise one number); how much of the buffer-type matrix
    ran, and on what: AMX and CPU_REPACK exist only on some hosts."""
    skips = terminalreporter.stats.get("skipped", [])
    if skips:
        terminalreporter.write_line(f"skipped {len(skips)}, by reason:")
        for why, n in Counter(map(_skip_reason, skips)).most_common():
            terminalreporter.write_line(f"  {n:>4}  {why}")
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
    from river_edge.host import cpu

    on = sum("-extra_bufts" in r.nodeid for r in reports)
    failed = sum(r.failed for r in reports)
    c = cpu()
    kinds = "AMX and CPU_REPACK" if "amx_int8" in c["isa"] else "CPU_REPACK" if c["isa"] else "none known"
    terminalreporter.write_line(
        f"buffer-type matrix: {len(reports)} cases ran ({on} with extra buffer types, {len(reports) - on} without; "
        f"{failed} failed) on {c['model']}, extra types this CPU offers: {kinds}")
