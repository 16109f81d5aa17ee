"""An alias from a LoRA adapter's name to the local replicas and a hosted model: served
under the adapter locally, and by the hosted model when no local replica can serve it
(its load fails as a sick engine fails), as any alias falls back."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from engines.errors import EngineUnavailable
from engines.lora import LoraRef
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.providers.conftest import KEY, Emulator, provider_settings
from tests.unit.local.lora_fake import LoraFakeEngine, adapter_dir

HOSTED = "anthropic/claude-sonnet-4-5"


def test_an_adapters_alias_falls_back_to_the_hosted_model(
    emulator: Emulator, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    emulator.admin("reset")
    resolve = tmp_path / "resolve"
    adapter_dir(resolve, "ad-r")
    engine = LoraFakeEngine(tokenizer, block_size=16)
    lora = {"enabled": True, "max_lora_rank": 8, "resolver_dir": str(resolve)}
    settings = provider_settings(
        emulator, engine={"lora": lora}, aliases={"ad-r": ["local", HOSTED]}
    )
    app = create_app(settings, [engine], provider_transport=emulator.transport)
    body = {"model": "ad-r", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    with TestClient(app) as http:
        http.headers["Authorization"] = f"Bearer {KEY}"
        engine.load_error = EngineUnavailable("the engine is restarting")
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-vcache-target"] == HOSTED  # the local replica could not load it
        assert engine.received == [] and len(emulator.received()) == 1
        engine.load_error = None
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-vcache-target"] == "local"
        assert engine.received[-1].lora == LoraRef("ad-r", str(resolve / "ad-r"))
        assert len(emulator.received()) == 1
