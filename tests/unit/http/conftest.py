"""The gateway most HTTP tests run against: the demo tokenizer behind the in-memory
engine (a 512-token context), no keys, no gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings


@pytest.fixture
def gw(demo_model: Path) -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512)
    with TestClient(create_app(gateway_settings(grpc_port=None), [engine])) as http:
        yield engine, http
