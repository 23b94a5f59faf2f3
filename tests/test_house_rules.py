"""Rules every package of the project keeps, read from the source: library code raises its own typed errors (each
also the built-in type that describes it), never a bare ``ValueError`` / ``TypeError`` / ``RuntimeError`` /
``Exception``; error classes live only in errors modules; test modules have unique basenames."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "tracestore", "tracerl", "schemas")
BARE = {"ValueError", "TypeError", "RuntimeError", "Exception", "KeyError", "LookupError", "OSError",
        "AssertionError", "NotImplementedError"}


#: the two idioms where the built-in type is the protocol: an abstract method's body, and a ``json.dumps(default=)``
#: hook, which must raise TypeError for what it cannot convert
PROTOCOL = {"NotImplementedError": "abstract method", "TypeError": "json default hook"}


def _protocol_use(node: ast.Raise, exc: ast.Name, func: ast.AST | None) -> bool:
    if exc.id == "NotImplementedError":
        return not isinstance(node.exc, ast.Call) or not node.exc.args  # a bare `raise NotImplementedError`
    return exc.id == "TypeError" and isinstance(func, ast.FunctionDef) and "json" in func.name


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text())


@pytest.mark.parametrize("pkg", PACKAGES)
def test_library_code_raises_typed_errors(pkg):
    bad = []
    for path, tree in _sources():
        if path.relative_to(ROOT).parts[0] != pkg:
            continue
        funcs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in BARE:
                    func = max((f for f in funcs if f.lineno <= node.lineno <= f.end_lineno), key=lambda f: f.lineno,
                               default=None)  # the innermost function around the raise
                    if not _protocol_use(node, exc, func):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} raises {exc.id}")
    assert not bad, bad


def _is_exception_class(node: ast.ClassDef) -> bool:
    return any(isinstance(b, (ast.Name, ast.Attribute)) and (getattr(b, "id", None) or b.attr).endswith(("Error",
               "Exception", "Warning")) for b in node.bases)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_error_classes_only_in_errors_modules(pkg):
    bad = []
    for path, tree in _sources():
        if path.relative_to(ROOT).parts[0] != pkg or path.name == "errors.py":
            continue
        bad += [f"{path.relative_to(ROOT)}:{n.lineno} defines {n.name}" for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef) and _is_exception_class(n)]
    assert not bad, bad


def test_test_modules_have_unique_basenames():
    """The tests' folders are not packages (pytest imports each test module by its basename, `pythonpath =
    tests`): two test files of one name in different folders make the second fail to collect ("import file
    mismatch"), which a run of either folder alone does not show."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, "test files with one basename: " + "; ".join(clashes)
