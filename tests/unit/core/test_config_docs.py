"""docs/configuration.md lists every setting as scripts/gen_config_docs.py writes it from
the settings models: a setting added, renamed, re-described or given a new default
without rerunning the script (``make config-docs``) fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from gateway.core.config import Settings

ROOT = Path(__file__).resolve().parents[3]


def _script() -> ModuleType:
    path = ROOT / "scripts" / "gen_config_docs.py"
    spec = importlib.util.spec_from_file_location("gen_config_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = _script()


def test_every_setting_has_a_description() -> None:
    assert gen.undocumented() == [], (
        "add a Field(description=...) or a comment above the field in the settings model, "
        "then run make config-docs"
    )


def test_the_committed_page_is_what_the_script_writes() -> None:
    page = gen.DOC.read_text()
    assert gen.rewrite(page, gen.render()) == page, (
        "docs/configuration.md is out of date with the settings models: run make config-docs"
    )


def test_every_field_of_the_settings_tree_has_a_row() -> None:
    names = {r.name.strip("`") for s in gen.sections(Settings) for r in s.rows}
    assert {"host", "allow_anonymous", "engine.max_model_len", "cache.retention.quantile"} <= names
    assert "api_keys[].limits.max_concurrent" in names
    assert "providers.<provider>.prices.<model prefix>.read_mult" in names
    assert "engine" not in names  # a section, not a row


class _Inner(BaseModel):
    depth: int = Field(3, ge=1, le=9)  # how deep


class _Outer(BaseModel):
    """An example."""

    # the mode,
    # on two lines
    mode: Literal["a", "b"] = "a"  # and beside
    size_bytes: int = Field(2 << 20, description="from the field", ge=1 << 20)
    inner: _Inner = Field(default_factory=_Inner)
    items: list[_Inner] = Field(default_factory=list)
    bare: str = ""


def test_rows_carry_name_env_flag_type_default_and_description() -> None:
    top, inner, items = gen.sections(_Outer, flags={"mode": "--mode"})
    assert top.about == "An example."
    mode, size, listed, bare = top.rows
    described = "the mode, on two lines and beside"
    assert mode == gen.Row("`mode`", "`VCACHE_MODE`", "`--mode`", '`"a" | "b"`', '`"a"`', described)
    assert (size.type, size.default) == ("`int` ≥ 1 MiB", "`2097152` (2 MiB)")
    assert size.description == "from the field"
    assert (listed.env, listed.default) == ("`VCACHE_ITEMS` (JSON)", "`[]`")
    assert bare.description == ""
    assert inner.rows[0] == gen.Row(
        "`inner.depth`", "`VCACHE_INNER__DEPTH`", "", "`int` ≥ 1, ≤ 9", "`3`", "how deep"
    )
    assert (items.name, items.rows[0].env) == ("items[]", "in `VCACHE_ITEMS`")
    assert gen.undocumented(_Outer) == ["items", "bare"]


def test_only_the_marked_part_is_rewritten() -> None:
    page = f"# Title\n\nprose\n\n{gen.BEGIN}\nold table\n{gen.END}\n\nmore prose\n"
    new = gen.rewrite(page, f"{gen.BEGIN}\nnew\n{gen.END}\n")
    assert new == f"# Title\n\nprose\n\n{gen.BEGIN}\nnew\n{gen.END}\n\nmore prose\n"
    with pytest.raises(ValueError, match="generated"):
        gen.rewrite("no markers", "x")
