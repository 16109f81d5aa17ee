"""What a component tells the other gateways (active-active): a fact's kind and body,
handed to a publisher (the state bus's ``publish``; ``gateway/state/bus.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Publish = Callable[[str, dict[str, Any]], None]


def no_one(kind: str, body: dict[str, Any]) -> None:
    """One gateway: nobody to tell (the default publisher)."""
