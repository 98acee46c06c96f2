"""The reference-import gate: an exercise file may not import the engine's own answers.

minikv ships the reference implementations of what the exercises ask for -- the hashers, keys and
scrubbers of ``minikv.security``, the oracle attack of ``minikv.attacks.prefix_oracle``, the
probing detector of ``minikv.audit.detector``, the statistics of ``minikv.audit.stats`` and the
isolation audit of ``minikv.audit.isolation``.  A file that imports them would be graded on the
engine's work, not the learner's, so :func:`forbidden_imports` reads the file's syntax tree (it
never runs it) and :func:`check_file` turns every hit into a message that says why.

Graded submissions (``make grade DIR=...``, ``strict``) get a stricter read -- a friendly first
message, not the security boundary: their code runs sealed in a child process
(:mod:`.sealed`), where none of this could reach the graders anyway.  Besides the graders themselves (``minikv.grading``,
except the given :mod:`.harness`), they may not import the process/introspection modules
(:data:`STRICT_MODULES`), use the escape hatches of :data:`STRICT_NAMES` (``open``, ``exec``,
``setattr`` ... and dunder attributes such as ``__globals__``), or assign to an attribute of an
imported module (``minikv.engine.engine.X = ...``: a monkeypatch).  None of the exercises needs
any of these.

This gate reads names, so a re-export (``from minikv.audit import ks_test``) or an attribute of a
module that imports the reference (``minikv.engine.engine`` loads ``minikv.security``) gets past
it; a graded submission's child refuses those modules by their *file*, whatever name reaches
them (:mod:`._reads`, :mod:`._sealed_child`).

Caught: ``import minikv.security``, ``from minikv.security.scrub import ...``, ``from minikv import
security``, ``from minikv.attacks import prefix_oracle``, and the same names written as strings
in ``importlib.import_module(...)`` / ``__import__(...)`` calls.  Submissions graded with
``make grade DIR=...`` are additionally refused any import of ``minikv.grading`` (the graders).
"""
from __future__ import annotations

import ast
from pathlib import Path

#: module prefixes an exercise file must never import, and why
FORBIDDEN: dict[str, str] = {
    "minikv.security": "minikv.security holds the reference hashers, tenant keys and scrubbers",
    "minikv.attacks.prefix_oracle": "minikv.attacks.prefix_oracle is the reference oracle attack",
    "minikv.audit.detector": "minikv.audit.detector is the reference probing detector",
    "minikv.audit.stats": "minikv.audit.stats is the reference KS test and ROC AUC",
    "minikv.audit.isolation": "minikv.audit.isolation is the reference isolation audit",
}
#: also forbidden in graded submissions: code that could reach into the graders
GRADER_MODULES: dict[str, str] = {"minikv.grading": "tampering: minikv.grading holds the graders themselves"}
#: strict mode: modules that reach the process, the interpreter or other code
STRICT_MODULES = ("os", "sys", "builtins", "importlib", "ctypes", "gc", "inspect", "subprocess", "socket",
                  "shutil", "pathlib", "io", "pickle", "marshal", "types", "threading", "multiprocessing",
                  "signal", "atexit", "unittest", "pytest")
#: strict mode: names and attributes that are escape hatches
STRICT_NAMES = frozenset({"open", "exec", "eval", "compile", "__import__", "globals", "vars", "setattr",
                          "delattr", "breakpoint", "input", "exit", "quit", "__builtins__"})
#: the given plumbing exercise files may import (no answer in it)
ALLOWED = ("minikv.grading.harness",)


def _hits(name: str, rules: dict[str, str]) -> str | None:
    if any(name == a or name.startswith(a + ".") for a in ALLOWED):
        return None
    for prefix, why in rules.items():
        if name == prefix or name.startswith(prefix + "."):
            return why
    return None


def _names(node: ast.AST) -> list[str]:
    """Absolute module names an import statement (or import call) can bring in."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level or not node.module:
            return []  # relative: the learner's own package
        if any(node.module == a for a in ALLOWED):
            return [node.module]
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        fn = node.func
        called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        if called in ("import_module", "__import__"):
            return [node.args[0].value]
    return []


def forbidden_imports(source: str, filename: str = "<exercise>",
                      rules: dict[str, str] = FORBIDDEN) -> list[tuple[int, str, str]]:
    """``[(line, module, why), ...]`` for every import of a forbidden module in ``source``.

    Raises ``SyntaxError`` if the source does not parse (the runner reports that separately)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        for name in _names(node):
            why = _hits(name, rules)
            if why:
                found.append((node.lineno, name, why))
                break
    return found


def strict_problems(source: str, filename: str = "<submission>") -> list[tuple[int, str]]:
    """``[(line, what), ...]``: what a graded submission may not do besides forbidden imports."""
    tree = ast.parse(source, filename)
    modules = set()  # names bound to imported modules
    found = []
    for node in ast.walk(tree):
        for name in _names(node):
            top = name.split(".")[0]
            if top in STRICT_MODULES:
                found.append((node.lineno, f"imports {name} (reaches the process or the interpreter)"))
        if isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Name) and node.id in STRICT_NAMES:
            found.append((node.lineno, f"uses {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr.startswith("__") and node.attr.endswith("__") \
                and node.attr not in ("__init__", "__name__", "__doc__"):
            found.append((node.lineno, f"reaches into {node.attr}"))
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            base = t
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(t, ast.Attribute) and isinstance(base, ast.Name) and base.id in modules:
                found.append((node.lineno, f"assigns to {ast.unparse(t)} (tampering: patches an imported module)"))
    return sorted(set(found))


def check_file(path: Path, grading_submission: bool = False, stub: str | None = None) -> list[str]:
    """Messages for every forbidden import in ``path`` (empty: the file may be graded).  With
    ``grading_submission``, also everything :func:`strict_problems` finds -- unless ``stub`` (the
    exercise's own generated stub) already does such things itself: the capstone's stub imports
    ``os`` and ``subprocess`` because an audit runs tools, so its file is exempt from the strict
    read (it runs sealed like every other; only the forbidden imports still apply)."""
    rules = {**FORBIDDEN, **(GRADER_MODULES if grading_submission else {})}
    try:
        source = Path(path).read_text(encoding="utf-8")
        hits = forbidden_imports(source, str(path), rules)
        strict = strict_problems(source, str(path)) if grading_submission else []
        exempt = bool(stub and grading_submission and strict_problems(stub))
    except (SyntaxError, ValueError):
        return []  # the import itself will fail and be reported with the syntax error
    except OSError as exc:
        return [f"{Path(path).name}: cannot be read ({exc.strerror})"]
    strict = [] if exempt else strict
    return [f"{Path(path).name}:{line} {what}: the exercises do not need this, so the grader refuses it "
            f"before running anything (your code runs sealed, apart from the graders; this check only "
            f"says so early)" for line, what in strict] + [f"{Path(path).name}:{line} imports {module}: {why}.  The grader refuses a file that imports it: "
            f"the grade must measure your code, not the engine's own answer.  Write it yourself."
            for line, module, why in hits]
