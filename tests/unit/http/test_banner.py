"""The ready banner: what serves where, logged once every replica is up."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings


def test_the_banner_names_the_urls_once_ready(
    demo_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)))
    settings = gateway_settings(grpc_port=None, port=8123)
    with (
        caplog.at_level(logging.INFO, logger="gateway"),
        TestClient(create_app(settings, [engine])) as http,
    ):
        for _ in range(200):
            if http.get("/readyz").status_code == 200 and "vcache is ready" in caplog.text:
                break
    text = caplog.text
    assert "vcache is ready" in text
    assert "http://127.0.0.1:8123/v1" in text and "http://127.0.0.1:8123/metrics" in text
    assert "models       vcache-demo" in text and "1 local" in text
    assert "starting replica replica-0 (1 of 1)" in text
