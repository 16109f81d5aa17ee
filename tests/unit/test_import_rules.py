"""Import rules: the manifest is pure, and gateway/ imports only down its stages.

::

    http, grpc ──▶ service ──▶ local, providers, sessions, state ──▶ core ──▶ engines, manifest

A stage may import itself and the stages below it, never one beside or above
it (``sessions`` never sees ``providers`` or ``local``; the edges reach the
engines only through ``service``).  The composition roots at the top of
gateway/ (``app``, ``cli``, ``session_cli``) wire everything together.
``engines`` and ``manifest`` never import ``gateway``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "manifest"
GATEWAY = ROOT / "gateway"
ALLOWED = {
    "__future__", "bisect", "collections", "contextlib", "dataclasses", "enum", "hashlib",
    "itertools", "json", "math", "operator", "re", "typing", "cbor2", "msgspec", "pydantic",
    "numpy", "manifest",
}  # fmt: skip
STAGES: dict[str, set[str]] = {
    "core": set(),
    "state": {"core"},
    "local": {"core"},
    "providers": {"core"},
    "sessions": {"core"},
    "service": {"core", "local", "providers", "sessions", "state"},
    "http": {"core", "service"},
    "grpc": {"core", "service"},
}
ROOTS = {"app", "cli", "session_cli", "plan_cli", "workers", "__init__"}


def _modules(path: Path) -> set[str]:
    """Every module ``path`` imports (function-level and TYPE_CHECKING imports included)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
    return names


def _imports(path: Path) -> set[str]:
    return {m.split(".")[0] for m in _modules(path)}


@pytest.mark.parametrize("path", sorted(MANIFEST.glob("*.py")), ids=lambda p: p.name)
def test_manifest_imports_only_pure_modules(path: Path) -> None:
    assert _imports(path) <= ALLOWED, f"{path.name} imports {_imports(path) - ALLOWED}"


def _stage(path: Path) -> str:
    rel = path.relative_to(GATEWAY).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


GATEWAY_FILES = sorted(p for p in GATEWAY.rglob("*.py") if "_pb2" not in p.name)


def test_every_gateway_module_has_a_stage() -> None:
    unknown = {_stage(p) for p in GATEWAY_FILES} - set(STAGES) - ROOTS
    assert not unknown, f"modules outside the stages: {unknown}"


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: str(p.relative_to(GATEWAY)))
def test_gateway_imports_only_down_its_stages(path: Path) -> None:
    stage = _stage(path)
    if stage in ROOTS:
        return
    allowed = STAGES[stage] | {stage}
    used = {
        m.split(".")[1] for m in _modules(path) if m.startswith("gateway.") and m.count(".") >= 1
    }
    assert used <= allowed, f"{stage} may not import {sorted(used - allowed)}"
    assert "gateway" not in _modules(path), "import the stage's modules, not the package"


@pytest.mark.parametrize(
    "path",
    sorted([*MANIFEST.rglob("*.py"), *(ROOT / "engines").rglob("*.py")]),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_engines_and_manifest_never_import_the_gateway(path: Path) -> None:
    assert "gateway" not in _imports(path)


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("from gateway.providers.path import ProviderPath\n")
    used = {m.split(".")[1] for m in _modules(bad) if m.startswith("gateway.")}
    assert not used <= STAGES["sessions"] | {"sessions"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle in ``graph`` (one per strongly connected component of more
    than one module, or a module that imports itself), found by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _gateway_graph() -> dict[str, set[str]]:
    names = {_module_name(p): p for p in GATEWAY_FILES}
    return {
        name: {m for m in _modules(path) if m in names and m != name}
        for name, path in names.items()
    }


def test_no_import_circle_inside_a_stage() -> None:
    """No modules of gateway/ import each other in a loop, directly or through others
    (TYPE_CHECKING and function-level imports count: they hide a circle, not cut it)."""
    assert _cycles(_gateway_graph()) == []


def test_the_circle_rule_catches_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
