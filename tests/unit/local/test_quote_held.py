"""What a priced local quote reads: the most of a prompt a serving replica holds, by the
exact index as it stands (the tenant's salt, never the last token, a dead replica not
counted)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.core.metrics import Metrics
from gateway.core.types import request_salt
from gateway.local.dispatch import Dispatcher
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from gateway.local.spans import KVSpans
from manifest.index import LocationId
from tests.unit.builders import booted

A, B = LocationId("replica-0"), LocationId("replica-1")
PROMPT = list(range(100))  # 6 full blocks of 16, and 4 tokens
SALT = request_salt("t", None)


class _Engine:
    def __init__(self) -> None:
        self.ready = True


@pytest.fixture
def held() -> Iterator[tuple[Dispatcher, KVSpans, list[_Engine]]]:
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
    engines = [_Engine(), _Engine()]
    for r in (A, B):
        kv.index.add_location(r)
    replicas = [Replica(r, e, None, None) for r, e in zip((A, B), engines, strict=True)]  # type: ignore[arg-type]
    yield Dispatcher(booted(replicas, kv), Router(), Metrics(), max_inflight=8), kv, engines


def test_the_replica_holding_the_most_of_the_prompt_is_quoted(
    held: tuple[Dispatcher, KVSpans, list[_Engine]],
) -> None:
    d, kv, _ = held
    hashes = kv.hashes(PROMPT, SALT)
    kv.index.apply_stored(A, hashes[:2])
    kv.index.apply_stored(B, hashes[:5])
    assert d.held(PROMPT, SALT) == 5 * 16
    assert d.held(PROMPT, request_salt("other", None)) == 0  # another tenant's spans


def test_a_replica_that_is_down_is_not_quoted(
    held: tuple[Dispatcher, KVSpans, list[_Engine]],
) -> None:
    d, kv, engines = held
    hashes = kv.hashes(PROMPT, SALT)
    kv.index.apply_stored(A, hashes[:2])
    kv.index.apply_stored(B, hashes)
    engines[1].ready = False
    assert d.held(PROMPT, SALT) == 2 * 16
