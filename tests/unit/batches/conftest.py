"""Gateways the batch tests run: the in-memory engine behind the demo tokenizer, two
tenants' keys, no gRPC; the official SDKs as clients through ``TestClient``."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.tokenizer import ChatTokenizer
from gateway.core.config import ApiKeyConfig, hash_api_key

MODEL = "vcache-demo"
KEY, OTHER = "sk-batch-one", "sk-batch-two"


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def keys() -> list[ApiKeyConfig]:
    return [
        ApiKeyConfig(sha256=hash_api_key(KEY), tenant="one", name="one"),
        ApiKeyConfig(sha256=hash_api_key(OTHER), tenant="two", name="two"),
    ]
