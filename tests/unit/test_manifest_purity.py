"""The manifest room is pure: no I/O, clocks, event loops or engine/HTTP imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MANIFEST = Path(__file__).resolve().parents[2] / "manifest"
ALLOWED = {
    "__future__", "bisect", "collections", "contextlib", "dataclasses", "enum", "hashlib",
    "itertools", "json", "math", "operator", "re", "typing", "cbor2", "msgspec", "pydantic",
    "manifest",
}  # fmt: skip


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(MANIFEST.glob("*.py")), ids=lambda p: p.name)
def test_manifest_imports_only_pure_modules(path: Path) -> None:
    assert _imports(path) <= ALLOWED, f"{path.name} imports {_imports(path) - ALLOWED}"
