"""The session log answers 503 once, and the client's retry is answered at once.

The whole local path as the gateway composes it: the service core, its loop and
journal, the session log over a SQLite store, the dispatcher with the exact index
(a fake engine core) and its default prefill wait, the claim age of 30 s; once
built from the service's parts (``tests/unit/builders.py``: the functions
``gateway/app.py`` uses), once the app itself over HTTP.  The store fails once
(its server restarting): the request is refused with 503 ``session_log_unavailable``
and Retry-After 2, and nothing it could have claimed is left (no prompt registered
as a running prefill, no admission or in-flight count).  The client's retry, with
the same prefix, is logged and answered without waiting on a prefill that never
started: far inside the 30 s a leaked registration would hold it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.providers.specs import adapter_for
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.errors import Unavailable
from gateway.core.metrics import Metrics
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.core.types import Principal
from gateway.local.replicas import Replica
from gateway.local.spans import KVSpans
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.store import SessionStore
from manifest.index import LocationId
from tests.settings import gateway_settings
from tests.unit.builders import booted, service
from tests.unit.local.fake_core import FakeCore

R = LocationId("replica-0")
MODEL = "vcache-demo"
CLAIM_AGE_S = 30.0  # how long a sibling waits for a running prefill at most (the default)
PROMPT = "You answer questions about the vcache manual, section by section.\n" * 4


class FailsOnce(SessionStore):
    """A store whose next append fails as a restarting server does."""

    failures = 1

    def append(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("server closed the connection unexpectedly")
        return super().append(*args, **kwargs)


def _request() -> ChatCompletionRequest:
    messages = [
        ChatMessage(role="system", content=PROMPT),
        ChatMessage(role="user", content="What does section one say?"),
    ]
    return ChatCompletionRequest(model=MODEL, messages=messages, max_tokens=2)


def test_a_session_log_503_leaves_no_claim_and_the_retry_does_not_wait(
    demo_model: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        tok = ChatTokenizer.from_pretrained(str(demo_model))
        engine = FakeEngine(tok, max_model_len=2048)
        await engine.start()
        kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
        kv.attach(R, FakeCore([], capacity=8, num_blocks=64), f"ipc://{tmp_path}/events", None)
        store = FailsOnce(tmp_path / "sessions.db")
        log = SessionLog(store, Reconstructor(adapter_for, lambda: tok), verify=True)
        metrics = Metrics()
        svc = service(booted([Replica(R, engine)], kv), metrics, log)
        d = svc.dispatcher
        who = Principal(tenant="t")
        try:
            with pytest.raises(Unavailable) as refused:
                await svc.chat(_request(), who)
            assert refused.value.code == "session_log_unavailable"
            assert refused.value.status == 503 and refused.value.retry_after_s == 2
            assert store.failures == 0 and engine.received == []  # not sent
            assert len(d.prefills) == 0  # no prompt registered for a sibling to wait on
            assert d.admission.inflight == 0 and [r.inflight for r in d.replicas] == [0]

            start = time.monotonic()  # the client's retry (after its Retry-After)
            routed = await asyncio.wait_for(svc.chat(_request(), who), CLAIM_AGE_S / 6)
            took = time.monotonic() - start
            assert took < CLAIM_AGE_S / 6, took
            answer = routed.body
            assert answer.choices[0].finish_reason is not None
            assert answer.usage is not None and answer.usage.prompt_tokens > 32  # 2 blocks
            get = metrics.registry.get_sample_value
            for outcome in ("joined", "timeout"):  # it never waited for a prefill
                assert not get("vcache_prefill_waits_total", {"outcome": outcome})
            assert routed.served.session is not None  # the retry is in the log
            assert len(engine.received) == 1 and len(d.prefills) == 0
        finally:
            svc.close()
            log.close()
            await kv.close()
            await engine.close()

    asyncio.run(main())


def test_over_http_the_503_says_retry_after_2_and_the_retry_is_answered_at_once(
    demo_model: Path, tmp_path: Path
) -> None:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=2048)
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
    kv.attach(R, FakeCore([], capacity=8, num_blocks=64), f"ipc://{tmp_path}/events", None)

    async def attach(replicas: Sequence[Replica]) -> KVSpans:
        return kv  # the exact spans the boot attaches to the replica

    store = FailsOnce(tmp_path / "sessions.db")
    app = create_app(gateway_settings(), [engine], attach_spans=attach, session_store=store)
    body = _request().model_dump(exclude_none=True)
    with TestClient(app) as client:
        refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["code"] == "session_log_unavailable"
        d = app.state.service.dispatcher
        assert len(d.prefills) == 0 and d.admission.inflight == 0
        assert engine.received == []

        start = time.monotonic()  # the client's retry
        answered = client.post("/v1/chat/completions", json=body)
        took = time.monotonic() - start
        assert answered.status_code == 200, answered.text
        assert took < CLAIM_AGE_S / 6, took
        assert answered.headers["x-vcache-replica"] == R
        assert answered.headers["x-vcache-session-kind"] == "new"  # in the log
        assert len(d.prefills) == 0 and len(engine.received) == 1
