"""Dependencies point downward: an import-graph check over every module of ``minikv``.

Every module is parsed with :mod:`ast` (nothing is imported), and every ``import`` counts,
including those inside functions: a lazy import is still a dependency, only a hidden one.  Each
module belongs to a *unit* (the longest matching prefix in ``UNITS``) and each unit to a layer.
A module may import its own unit, or a unit of a strictly lower layer; units of one layer are
peers and never import each other.  docs/ARCHITECTURE.md ("Layers") explains the map.

And no module imports itself round a circle, inside a unit or across: the second half of this file
finds every circle in the module graph and names the files and lines that close it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minikv"

#: lowest layer first; the units of one layer are peers
LAYERS = (
    ("minikv._lazy", "minikv.home", "minikv.security"),  # primitives: no minikv imports but these
    ("minikv.engine", "minikv.models"),             # the engine; where checkpoints come from
    # what the composition root (minikv.llm) plugs into the engine: the recorder; KV tiers below its
    # pool; the fast paths behind model_runner.Backend; the selective-sharing strategies
    ("minikv.audit.trail", "minikv.tiers", "minikv.backends", "minikv.sharing"),
    ("minikv.llm",),                                # the front door: composes the three above
    ("minikv.audit", "minikv.serve", "minikv.attacks"),  # tools that drive or read an engine
    ("minikv.viz", "minikv.edge", "minikv.grading", "minikv.gateway"),  # built on those tools
    ("minikv", "minikv.cli", "minikv.__main__", "minikv.bench"),  # entry points (minikv.bench: every section)
)
ENTRY_POINTS = LAYERS[-1]
#: modules that belong to a unit other than their own name: the trail's file writer is part of
#: the recorder, and the entry points are one unit (``minikv`` alone is the package's __init__)
UNITS = ({unit: unit for layer in LAYERS for unit in layer} | {"minikv.audit.rotation": "minikv.audit.trail"}
         | {m: "minikv" for m in ENTRY_POINTS})
LAYER = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str | None:
    """The unit of ``module``: its longest prefix listed in ``UNITS`` (None: in no layer)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        unit = UNITS.get(".".join(parts[:n]))
        if unit is not None:
            return unit
    return UNITS["minikv"] if module == "minikv" else None


def imports(source: str, module: str, is_package: bool, known: set[str]):
    """``(line, imported minikv module)`` for every import in ``source``, at any depth."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "minikv":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "minikv":
                continue
            for alias in node.names:  # `from minikv.audit import trail` imports minikv.audit.trail
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in known else target
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).startswith("minikv")):
            yield node.lineno, node.args[0].value


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every upward or sideways import in ``{module: (source, is_package)}``, as readable lines."""
    known = set(sources)
    found = []
    for module, (source, is_package) in sorted(sources.items()):
        here = unit_of(module)
        for line, target in imports(source, module, is_package, known):
            there = unit_of(target)
            if there is None or here is None or there == here:
                continue
            if LAYER[there] > LAYER[here]:
                found.append(f"{module} line {line} imports {target}: {there} (layer {LAYER[there]}) "
                             f"is above {here} (layer {LAYER[here]})")
            elif LAYER[there] == LAYER[here]:
                found.append(f"{module} line {line} imports {target}: {there} and {here} are peers "
                             f"(layer {LAYER[here]}) and never import each other")
    return found


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
            for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer():
    missing = [m for m in package_sources() if unit_of(m) is None]
    assert not missing, f"modules in no layer (add their package to LAYERS): {missing}"


def test_dependencies_point_downward():
    found = violations(package_sources())
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_the_engine_imports_neither_audit_nor_serve_nor_the_model_hub():
    engine = {m: s for m, s in package_sources().items() if unit_of(m) == "minikv.engine"}
    known = set(package_sources())
    bad = [f"{m} line {line} imports {t}" for m, (src, pkg) in engine.items()
           for line, t in imports(src, m, pkg, known)
           if unit_of(t) in ("minikv.audit", "minikv.audit.trail", "minikv.serve", "minikv.models")]
    assert not bad, bad


#: what the engine is handed, never imports: the textbook path stays readable on its own
PLUGGED_IN = ("minikv.backends", "minikv.tiers", "minikv.sharing")


def plugged_in_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import of a backend, a KV tier or a sharing strategy by a module of ``minikv.engine``."""
    known = set(sources)
    return [f"{m} line {line} imports {t}" for m, (src, pkg) in sorted(sources.items())
            if unit_of(m) == "minikv.engine"
            for line, t in imports(src, m, pkg, known) if unit_of(t) in PLUGGED_IN]


def test_the_engine_imports_no_backend_tier_or_sharing_strategy():
    assert all(u in LAYER for u in PLUGGED_IN)
    bad = plugged_in_imports(package_sources())
    assert not bad, "the engine is handed these (minikv.llm composes them), it never imports them:\n" + "\n".join(bad)


@pytest.mark.parametrize("module,source,culprit", [
    ("minikv.engine.model_runner", "from ..backends.fused import FusedBackend\n", "line 1 imports minikv.backends.fused"),
    ("minikv.engine.engine", "def f():\n    import minikv.backends.cpu_kernels\n", "line 2 imports minikv.backends.cpu_kernels"),
    ("minikv.engine.kv_pool", "from minikv.backends import host_memory\n", "line 1 imports minikv.backends.host_memory"),
    ("minikv.engine.block_manager", "from ..tiers import attach_tiers\n", "line 1 imports minikv.tiers"),
    ("minikv.engine.engine", "from ..sharing import make_sharing\n", "line 1 imports minikv.sharing"),
])
def test_a_planted_backend_tier_or_sharing_import_in_the_engine_is_named(module, source, culprit):
    sources = package_sources()
    sources[module] = (source, False)
    found = plugged_in_imports(sources)
    assert any(f == f"{module} {culprit}" for f in found), found
    assert any(f.startswith(f"{module} {culprit}:") for f in violations(sources)), "the layer check names it too"


@pytest.mark.parametrize("module,source,culprit", [
    ("minikv.engine.engine", "def f():\n    from ..audit.trail import AuditTrail\n", "line 2 imports minikv.audit.trail"),
    ("minikv.engine.engine", "from ..models.hub import resolve_model\n", "line 1 imports minikv.models.hub"),
    ("minikv.engine.block_manager", "from ..tiers.link import TierLink\n", "line 1 imports minikv.tiers.link"),
    ("minikv.tiers.link", "from ..audit.trail import AuditTrail\n", "line 1 imports minikv.audit.trail"),
    ("minikv.audit.isolation_cli", "from ..serve.cli import add_engine_arguments\n", "line 1 imports minikv.serve.cli"),
    ("minikv.security.hashing", "import minikv.engine.block_manager\n", "line 1 imports minikv.engine.block_manager"),
    ("minikv.audit.trail", "from ..llm import LLM\n", "line 1 imports minikv.llm"),
])
def test_an_upward_or_sideways_import_is_named(module, source, culprit):
    sources = package_sources()
    sources[module] = (source, False)
    found = violations(sources)
    assert any(f.startswith(f"{module} {culprit}:") for f in found), found


# --- no import circles ----------------------------------------------------------------------------
# Layers order *units*; inside a unit (the entry points are one) modules may import each other, and
# two of them importing each other is a circle: which one is imported first decides which sees the
# other half-initialised, and a lazy import only hides that.  So the module graph must be acyclic.

def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """``{module: {imported minikv module: first line}}`` over ``sources``, imports at any depth."""
    known = set(sources)
    graph: dict[str, dict[str, int]] = {}
    for module, (source, is_package) in sources.items():
        edges = graph.setdefault(module, {})
        for line, target in imports(source, module, is_package, known):
            if target in known and target != module:
                edges.setdefault(target, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle ``[a, b, ..., a]`` per strongly connected group of modules (Tarjan's algorithm,
    iterative: the package is deep enough to make recursion a worry), in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [_circle_through(group, graph) for group in sorted(groups)]


def _circle_through(group: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest circle from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    return paths[node] + [start]
                if child in members and child not in paths:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{group} is not strongly connected")  # Tarjan's groups always are


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]], packages: set[str]) -> str:
    """``minikv/a.py line 3 -> minikv/b/__init__.py line 9 -> minikv/a.py``: files, not modules."""
    def file(m: str) -> str:
        return m.replace(".", "/") + ("/__init__.py" if m in packages else ".py")
    hops = [f"{file(a)} line {graph[a][b]}" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(hops + [file(cycle[-1])])


def cycle_report(sources: dict[str, tuple[str, bool]]) -> list[str]:
    graph = import_graph(sources)
    packages = {m for m, (_, is_package) in sources.items() if is_package}
    return [describe_cycle(c, graph, packages) for c in import_cycles(graph)]


def test_the_cycle_finder_on_a_synthetic_graph():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"f": 5}, "f": {"e": 6},
             "g": {"a": 7}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert import_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []


def test_no_import_cycles_among_minikv_modules():
    found = cycle_report(package_sources())
    assert not found, "import circles (move the shared names down into a module both import):\n" + "\n".join(found)


@pytest.mark.parametrize("module,is_package,source,expected", [
    # a lazy import inside a function still closes a circle
    ("minikv.bench.prefill", False, "def f():\n    from .speed import format_engine\n",
     "minikv/bench/speed.py line"),
    # a TYPE_CHECKING-only import too: it is a dependency a type checker follows
    ("minikv.engine.sampling", False, "if TYPE_CHECKING:\n    from .sequence import Sequence\n",
     "-> minikv/engine/sequence.py line"),
    # through a package's __init__
    ("minikv.bench.base", False, "from .sharing import ZIPF\n", "minikv/bench/sharing/__init__.py line"),
])
def test_a_planted_cycle_is_named_by_its_files(module, is_package, source, expected):
    sources = package_sources()
    sources[module] = (sources[module][0] + "\n" + source, is_package)
    found = cycle_report(sources)
    assert any(expected in f and module.replace(".", "/") in f for f in found), found
