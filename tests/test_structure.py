"""The house's shape: folders are import paths, imports at the top of modules unless they spare a measured start-up\ncost, no import circles (lazy imports inside functions count), short modules, one home for the mode vocabulary, the\nproduct apart from its measurement wing."""
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


def imports(name: str, f: Path, mods: dict[str, Path]) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function) for each module an import statement names; `from pkg import sub`
    names the submodule."""
    out = []

    def walk(node, lazy):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.ImportFrom):
                if ch.level:
                    base = name.split(".")[: len(name.split(".")) - ch.level + (f.name == "__init__.py")]
                    mod = ".".join(base + ([ch.module] if ch.module else []))
                else:
                    mod = ch.module or ""
                subs = [f"{mod}.{a.name}" for a in ch.names if f"{mod}.{a.name}" in mods]
                out.extend((ch.lineno, m, lazy) for m in subs or [mod])
            elif isinstance(ch, ast.Import):
                out.extend((ch.lineno, a.name, lazy) for a in ch.names)
            else:
                walk(ch, lazy or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(f.read_text()), False)
    return out


def import_graph(lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (with lazy=False, only at its top)."""
    mods = modules()
    return {name: {m for _, m, inside in imports(name, f, mods) if m in mods and (lazy or not inside)} - {name}
            for name, f in mods.items()}


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


def test_folders_are_import_paths():
    """cli/ and gguf_tools/ at the top of the repository are links into river_edge/, where they import from; nothing
    remaps a package to another folder."""
    import tomllib

    assert (ROOT / "cli").resolve() == PACKAGE / "cli" and (ROOT / "gguf_tools").resolve() == PACKAGE / "gguf_tools"
    assert "package-dir" not in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


# Imports stay at the top of a module. One inside a function must spare the module's importers one of these, which the
# module does not load at its own top (directly or through the project's top-level imports): seconds to import, from
# `python -X importtime` on the Intel host (Sapphire Rapids, 2 cores). `river --help` loads none of them.
HEAVY = {
    "torch": 2.7,
    "matplotlib": 0.9,                 # pyplot
    "llama_cpp": 0.2,                  # and libllama with ggml's backends
    "llama_cpp.server": 0.7,           # beyond llama_cpp: fastapi, uvicorn, pydantic, starlette
    "fastapi": 0.25,
    "uvicorn": 0.17,
}
# Or be listed here, with its reason.
LAZY = {
    ("river_edge.chat", "readline"): "imported for its effect on input() (line editing), only where a terminal is "
                                     "read; absent on Windows",
    ("river_edge.measure.probe", "resource"): "the peak-RSS fallback off Linux; POSIX only",
}


def heavy_reach(graph_top: dict[str, set[str]], third: dict[str, set[str]]):
    """The HEAVY modules a module loads through its top-level imports."""
    memo: dict[str, set[str]] = {}

    def reach(m: str) -> set[str]:
        if m not in graph_top:
            return {h for h in HEAVY if m == h or m.startswith(h + ".")}
        if m not in memo:
            memo[m] = set()
            memo[m] = set().union(*(reach(d) for d in graph_top[m] | third[m]), set())
        return memo[m]

    return reach


def test_imports_inside_functions_spare_a_measured_cost():
    mods = modules()
    listed = {name: imports(name, f, mods) for name, f in mods.items()}
    top = {n: {m for _, m, lazy in im if m in mods and not lazy} for n, im in listed.items()}
    third = {n: {m for _, m, lazy in im if m not in mods and not lazy} for n, im in listed.items()}
    reach = heavy_reach(top, third)
    assert reach("river_edge.calibration.report") >= {"torch"} and reach("river_edge.format") == set()  # it is real
    needless = [f"{n}:{line} imports {m} inside a function" for n, im in listed.items() for line, m, lazy in im
                if lazy and not reach(m) - reach(n) and (n, m) not in LAZY]
    assert needless == []
    assert {(n, m) for n, im in listed.items() for _, m, lazy in im if lazy} >= set(LAZY)   # no stale entries


def test_the_cli_starts_without_the_heavy_modules():
    """`river --help` and every verb's module: none of HEAVY is imported until a command runs."""
    import subprocess
    import sys

    code = ("import sys, river_edge.cli.main; "
            f"print(sorted(m for m in {sorted(HEAVY)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_package_is_installed():
    """pyproject.toml lists packages explicitly: a new folder left out would import here (editable) and be
    missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, f in modules().items() if f.name == "__init__.py"}
    assert found <= listed, sorted(found - listed)



def test_the_readme_names_the_python_the_code_needs():
    """The README's Python floor is pyproject's, and this suite runs on it (tomllib: 3.11); it said 3.10+."""
    import re
    import tomllib

    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    said = re.findall(r"Python (3\.\d+)\+", (ROOT / "README.md").read_text())
    assert said and set(said) == {floor.removeprefix(">=")}, (said, floor)
    assert tuple(map(int, floor.removeprefix(">=").split("."))) >= (3, 11)

# Modules allowed past 400 lines, and why (the house's rule: split a module that grows past it). None today.
LONG: dict[str, str] = {}


def test_no_module_is_long_without_a_reason():
    long = {name: n for name, f in modules().items() if (n := len(f.read_text().splitlines())) > 400}
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



def test_bench_is_a_package_that_the_product_never_imports():
    """bench/'s modules import each other as bench.NAME (run as `python -m bench.NAME`), never as bare names that
    only resolve with bench/ itself on sys.path; river_edge imports nothing of bench."""
    import ast

    def imported(p: Path) -> list[tuple[int, str]]:
        return [(node.lineno, n) for node in ast.walk(ast.parse(p.read_text()))
                for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                          [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])]

    siblings = {p.stem for p in (ROOT / "bench").glob("*.py")}
    bare = [f"{p.name}:{i} {n}" for p in sorted((ROOT / "bench").glob("*.py")) for i, n in imported(p)
            if n.split(".")[0] in siblings]
    assert bare == []
    product = [f"{p}:{i}" for p in sorted((ROOT / "river_edge").rglob("*.py")) for i, n in imported(p)
               if n.split(".")[0] == "bench"]
    assert product == []

# what of a llama_cpp.Llama is private: reached by river_edge/runtime/decoder.py (the one seam) and llama.py alone
PRIVATE = r"\._(?:ctx|model|batch|river|n_vocab|n_ctx|input_ids|requires_eval|seed|logits_all|init_sampler|spec)\b"


def test_the_decoding_modes_and_the_tests_reach_the_model_through_its_decoder():
    """The decoding modes (spec, exact, gated, costs, drafters) touch no private attribute of a model: decoder.py is
    their seam. Tests drive the modes through it and `llm.decoding`' declared options; one test swaps in a context of
    two sequences (the model's own holds one), and says so."""
    import re

    pat = re.compile(PRIVATE)
    modes = [ROOT / "river_edge" / "runtime" / f"{m}.py" for m in ("spec", "exact", "gated", "costs", "drafters")]
    assert {f.name: pat.findall(f.read_text()) for f in modes} == {f.name: [] for f in modes}
    found = {f.name: len(pat.findall(f.read_text())) for f in (ROOT / "tests").glob("test_*.py")
             if f.name != "test_structure.py"}
    assert {k: v for k, v in found.items() if v} == {"test_runtime.py": 2}
    assert pat.search("llm._ctx.decode(b)") and not pat.search("llm.decoder.decode(b)")


def test_the_summary_counts_skips_per_reason():
    """`make test` ends with its skips counted per reason (48 skips were one number, 40 of them the device tests)."""
    from types import SimpleNamespace

    import conftest

    skip = lambda why: SimpleNamespace(longrepr=("tests/x.py", 1, f"Skipped: {why}"), nodeid="tests/x.py::t")  # noqa: E731
    lines = []
    rep = SimpleNamespace(stats={"skipped": [skip("no device")] * 3 + [skip("no AMX")]}, write_line=lines.append)
    conftest.pytest_terminal_summary(rep)
    assert lines == ["skipped 4, by reason:", "     3  no device", "     1  no AMX"]


def test_only_the_decoder_moves_the_kept_tokens():
    """`n_tokens` and `input_ids` (the tokens the KV cache holds) are written by decoder.py alone, whose `accept` and
    `cut` move the tokens and their cells together: written anywhere else they can fall out of step with the cache."""
    def written(tree) -> list[int]:
        out = []
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    while isinstance(e, ast.Subscript):
                        e = e.value
                    if isinstance(e, ast.Attribute) and e.attr in ("n_tokens", "input_ids"):
                        out.append(node.lineno)
        return out

    assert written(ast.parse("llm.n_tokens = 0\nllm.input_ids[3:5] = t\na, m.n_tokens = 1, 2\nx.n_tokens += 1")) == \
        [1, 2, 3, 4]   # the finder finds
    bad = {name: lines for name, f in modules().items() if name != "river_edge.runtime.decoder"
           and (lines := written(ast.parse(f.read_text())))}
    assert bad == {}
    assert written(ast.parse((PACKAGE / "runtime" / "decoder.py").read_text()))   # the one place that does


# The per-architecture reference files (river_edge/reference/<arch>.py) share one interface on purpose, as mlx-lm's
# model files each define Model and ModelArgs: each defines its decoder layer as Block (a subclass of llama.py's), and
# reference/model.py picks one by the GGUF's architecture from its BLOCKS table. An exception to one meaning per
# name, and it holds in those files alone.
PER_ARCHITECTURE = {"Block": "each reference/<arch>.py's decoder layer, picked by reference/model.py's BLOCKS"}
# Each script's entry point is main by convention (`python -m bench.NAME`, `python patches/build.py`,
# measure/sandbox_init.py's child): the other exception, and it holds only in modules that run it as __main__.
ENTRY_POINT = {"main": "each script's entry point, run under its `if __name__ == \"__main__\"`"}


def named_files() -> dict[str, Path]:
    """The modules one meaning per name covers: the package (modules()), the measurement wing bench/ (a package, run
    as `python -m bench.NAME`) and the build scripts patches/*.py, each once. The top-level cli/ and gguf_tools/ are
    symlinks into river_edge/ and are not walked again."""
    out = dict(modules())
    out.update({f"bench.{f.stem}": f for f in (ROOT / "bench").glob("*.py") if f.name != "__init__.py"})
    out["bench"] = ROOT / "bench" / "__init__.py"
    out.update({f"patches.{f.stem}": f for f in (ROOT / "patches").glob("*.py")})
    files = [f.resolve() for f in out.values()]
    assert len(files) == len(set(files)), "a file walked twice"
    return out


def defined_names(tree: ast.Module) -> set[str]:
    """The module-level names `tree` defines: def, class, assignment (a tuple's names too)."""
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            found.update(e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name))
    return found


def public_names(files: dict[str, Path] | None = None) -> dict[str, list[str]]:
    """Each module-level public name (def, class, assignment; no leading `_`) -> the modules that define it."""
    out: dict[str, list[str]] = {}
    for name, f in sorted((named_files() if files is None else files).items()):
        for n in defined_names(ast.parse(f.read_text())):
            if not n.startswith("_"):
                out.setdefault(n, []).append(name)
    return out


def runs_as_main(f: Path) -> bool:
    return any(isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", "'__main__' == __name__")
               for node in ast.parse(f.read_text()).body)


def repeated(names: dict[str, list[str]]) -> dict[str, list[str]]:
    return {n: ms for n, ms in names.items() if len(ms) > 1 and n not in PER_ARCHITECTURE and n not in ENTRY_POINT}


def test_each_public_name_is_defined_once():
    """One meaning per name: `git grep 'def NAME'` finds one, across river_edge/, bench/ and patches/*.py. A second
    module's `run` or `Settings` is a different thing under the same name (measure/bench.py's run and
    measure/evaluate.py's were, as were bench/upcast.py's, bench/steps.py's and patches/build.py's), and a reader, a
    grep or an import takes the wrong one. Module-level functions, classes and assignments count; names with a
    leading `_` do not (a script's own folder is _HERE)."""
    files = named_files()
    names = public_names(files)
    assert len(names["Block"]) > 1 and names["rank_vocabulary"] == ["river_edge.defaults"]   # the walk is real
    assert names["run_steps"] == ["bench.steps"] and names["build_aarch64"] == ["patches.cross"]   # bench/, patches/
    assert not any(m.startswith(("cli.", "gguf_tools.")) for ms in names.values() for m in ms)   # symlinks: not again
    assert repeated(names) == {}, repeated(names)
    model = ast.parse((PACKAGE / "reference" / "model.py").read_text())
    blocks = next(node.value for node in model.body if isinstance(node, ast.Assign)
                  and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["BLOCKS"])
    arch = {f"river_edge.reference.{v.value.id}" for v in blocks.values}
    assert {m for n in PER_ARCHITECTURE for m in names[n]} == arch   # the exception: reference/<arch>.py alone
    assert len(names["main"]) > 1 and all(runs_as_main(files[m]) for n in ENTRY_POINT for m in names[n])   # scripts'


def test_a_repeated_name_is_found(tmp_path):
    """The check finds a name two modules define, wherever they live, and lets the two exceptions through."""
    (tmp_path / "a.py").write_text("def load():\n    pass\n\n\ndef main():\n    pass\n\n\n"
                                   "if __name__ == '__main__':\n    main()\n")
    (tmp_path / "b.py").write_text("load, _HERE = 1, 2\nBlock = None\n")
    files = {"bench.a": tmp_path / "a.py", "patches.b": tmp_path / "b.py", "bench.steps": ROOT / "bench" / "steps.py"}
    assert repeated(public_names(files)) == {"load": ["bench.a", "patches.b"]}
    assert runs_as_main(tmp_path / "a.py") and not runs_as_main(tmp_path / "b.py")


def test_a_greedy_exact_tokens_path_reads_in_short_functions():
    """docs/design.md section 2: a greedy exact token from `river chat` to llama_decode and back passes through these,
    each short enough to read at once (under 60 lines)."""
    path = {"chat.py": ["Chat.ask"], "runtime/llama.py": ["RiverLlama.generate"],
            "runtime/spec.py": ["Spec.generate", "Spec._timed_gen"],
            "runtime/exact.py": ["ExactCall.run", "ExactCall.draft", "ExactCall.verify", "ExactCall.accept",
                                 "ExactCall.settle", "ExactCall.keep", "ExactCall.emit"],
            "runtime/decoder.py": ["Decoder.verify", "Decoder.decode", "Decoder.accept"]}
    for rel, names in path.items():
        tree = ast.parse((PACKAGE / rel).read_text())
        found = {f"{c.name}.{f.name}": f.end_lineno - f.lineno + 1 for c in tree.body if isinstance(c, ast.ClassDef)
                 for f in c.body if isinstance(f, ast.FunctionDef)}
        for name in names:
            assert name in found and found[name] < 60, (rel, name, found.get(name))
