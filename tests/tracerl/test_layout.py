"""The house rules of tracerl's layout, read from the source: rollout and train never import each other, arrows
between rooms point one way (no circles), nothing private crosses a sub-package border, tracerl goes through
tracestore's public API, and the flat module paths of tracerl 0.1 still import (with a DeprecationWarning)."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

from tracerl.deprecation import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[2]
TRACERL = ROOT / "tracerl"
ROOMS = ("policy", "rollout", "sglang", "hints", "train", "artifacts", "audit", "loop", "cli")


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports() -> list[tuple[str, str, list[str], int]]:
    """(importing module, imported module, names, line) of every absolute import in tracerl/, lazy ones too."""
    out = []
    for path in TRACERL.rglob("*.py"):
        mod = _module_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append((mod, node.module, [a.name for a in node.names], node.lineno))
            elif isinstance(node, ast.Import):
                out.extend((mod, a.name, [], node.lineno) for a in node.names)
    return out


def _room(module: str) -> str | None:
    """The sub-package (room) a module belongs to; None for tracerl's top-level modules (config, errors, util, ...)
    and for other packages."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tracerl" and len(parts) > 1 and parts[1] in ROOMS else None


def test_rollout_and_train_do_not_import_each_other():
    bad = [(a, b, line) for a, b, _, line in _imports()
           if {_room(a), _room(b)} == {"rollout", "train"}]
    assert not bad, bad


def test_rooms_form_no_circle():
    edges: dict[str, set[str]] = {}
    for a, b, names, _ in _imports():
        src, dst = _room(a), _room(b)
        if src and dst and src != dst:
            edges.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges.get(start, ()))

    circles = sorted(r for r in edges if reaches(r, r, {r}))
    assert not circles, {r: sorted(edges[r]) for r in circles}


def test_nothing_private_crosses_a_room_border():
    bad = []
    for a, b, names, line in _imports():
        src, dst = _room(a), _room(b)
        private_module = any(p.startswith("_") for p in b.split("."))
        if b.startswith("tracerl") and dst != src and (private_module or any(n.startswith("_") for n in names)):
            bad.append(f"{a}:{line} imports {b} {names}")
    assert not bad, bad


def test_tracerl_uses_only_tracestores_public_api():
    bad = [f"{a}:{line} imports {b}" for a, b, _, line in _imports()
           if b.startswith("tracestore.") and b not in ("tracestore.errors", "tracestore.cliargs")]
    assert not bad, bad
    sources = "\n".join(p.read_text() for p in TRACERL.rglob("*.py"))
    assert ".backend.put" not in sources and "store.backend" not in sources


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_old_module_paths_import_with_a_deprecation_warning(old):
    new = importlib.import_module(MOVED_MODULES[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=old.replace(".", r"\.")):
        mod = importlib.import_module(old)
    assert mod is new


@pytest.mark.parametrize("package, name, home", [
    ("tracerl.train", "MetricsLog", "tracerl.runlog"),
    ("tracerl.train", "json_ready", "tracerl.runlog"),
    ("tracerl.train", "CODES_KEY", "tracerl.artifacts.codes"),
    ("tracerl.policy", "create_loop_store", "tracerl.loop.store"),
    ("tracerl.audit", "load_setup", "tracerl.audit.setup"),
    ("tracerl.loop", "LoopProcessError", "tracerl.errors"),
])
def test_moved_names_are_forwarded_with_a_deprecation_warning(package, name, home):
    pkg = importlib.import_module(package)
    pkg.__dict__.pop(name, None)  # an earlier test may have cached it
    with pytest.warns(DeprecationWarning, match=f"{package}.{name}"):
        value = getattr(pkg, name)
    assert value is getattr(importlib.import_module(home), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(pkg, name) is value  # warned once
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pkg.nope
