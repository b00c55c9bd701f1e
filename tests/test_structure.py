"""The house's shape: no import circles among the project's modules (lazy imports inside functions count)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "river_edge"


def modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = [p for p in f.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        out[".".join(parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + (f.name == "__init__.py")]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                deps.update(subs or ([mod] if mod in mods else []))
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, stack, found = {}, [], []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    assert "river_edge.calibration.rule" in graph and graph["river_edge.calibration.report"]  # the graph is real
    assert cycles(graph) == []


def test_every_package_is_installed():
    """pyproject.toml lists packages explicitly: a new folder left out would import here (editable) and be
    missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, f in modules().items() if f.name == "__init__.py"}
    assert found <= listed, sorted(found - listed)


# Modules allowed past ~400 lines, and why (the house's rule: split a module that grows past it).
LONG = {
    "river_edge.runtime.spec": "exact mode's draft-verify loop is one generator whose state (cache, cost model, "
                               "sampler) a split would thread through every piece",
}


def test_no_module_is_long_without_a_reason():
    long = {name: n for name, f in modules().items() if (n := len(f.read_text().splitlines())) > 420}
    assert set(long) <= set(LONG), {k: v for k, v in long.items() if k not in LONG}


def test_measurement_imports_no_matplotlib():
    """The memory probes import the measurement modules before their baseline: matplotlib (~33 MiB) would count."""
    import subprocess
    import sys

    code = ("import sys, river_edge.measure.modes, river_edge.measure.bench, river_edge.measure.plots; "
            "sys.exit('matplotlib' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_one_home_for_the_mode_vocabulary():
    """The modes and each front end's default live in format.py; a literal of three or more modes and nothing
    else, or a mode string as a fallback default (`mode or "exact"`), anywhere else is a second home. (A
    benchmark's list of configurations mixes modes with files and variants: a selection, not the vocabulary.)"""
    from river_edge.format import DEFAULT_MODE, MODES

    bad = []
    for name, f in modules().items():
        if name == "river_edge.format":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                named = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if len(named) >= 3 and len(named) == len(node.elts) and named <= set(MODES):
                    bad.append(f"{name}:{node.lineno} lists {sorted(named)}")
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
                last = node.values[-1]
                if isinstance(last, ast.Constant) and last.value in MODES:
                    bad.append(f"{name}:{node.lineno} defaults to {last.value!r}")
    assert bad == []
    assert set(DEFAULT_MODE.values()) <= set(MODES)


def test_the_product_does_not_import_the_measurement_wing():
    """river_edge.measure holds the benchmarks behind `river bench` and `river eval`; the rest of the product (the
    runtime, calibration, GGUF tools, chat, serve, doctor) never imports it, and the report writers and studies that
    only the repository's pages use live in bench/, outside the package."""
    graph = import_graph()
    verbs = {"river_edge.cli.bench", "river_edge.cli.evaluate", "river_edge.cli.demo", "river_edge.cli.main"}
    bad = {m: sorted(d for d in deps if d.startswith("river_edge.measure"))
           for m, deps in graph.items() if not m.startswith("river_edge.measure") and m not in verbs}
    assert {m: d for m, d in bad.items() if d} == {}
    assert not {"report", "headline", "longrun", "quality", "upcast", "levers"} & \
        {n.split(".")[-1] for n in graph if n.startswith("river_edge.measure.")}


# what of a llama_cpp.Llama is private: reached by river_edge/runtime/decoder.py (the one seam) and llama.py alone
PRIVATE = r"\._(?:ctx|model|batch|river|n_vocab|n_ctx|input_ids|requires_eval|seed|logits_all|init_sampler|spec)\b"


def test_the_decoding_modes_and_the_tests_reach_the_model_through_its_decoder():
    """The decoding modes (spec, gated, costs, drafters) touch no private attribute of a model: decoder.py is their
    seam. Tests drive the modes through it and `llm.modes`' declared options; one test swaps in a context of two
    sequences (the model's own holds one), and says so."""
    import re

    pat = re.compile(PRIVATE)
    modes = [ROOT / "river_edge" / "runtime" / f"{m}.py" for m in ("spec", "gated", "costs", "drafters")]
    assert {f.name: pat.findall(f.read_text()) for f in modes} == {f.name: [] for f in modes}
    found = {f.name: len(pat.findall(f.read_text())) for f in (ROOT / "tests").glob("test_*.py")
             if f.name != "test_structure.py"}
    assert {k: v for k, v in found.items() if v} == {"test_runtime.py": 2}
    assert pat.search("llm._ctx.decode(b)") and not pat.search("llm.decoder.decode(b)")
