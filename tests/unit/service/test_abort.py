"""Closing a stream in the service core aborts its engine request (no HTTP involved)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.core.metrics import Metrics
from gateway.core.schemas import ChatCompletionRequest, ChatMessage
from gateway.core.types import Principal
from gateway.local.replicas import Replica
from manifest.index import LocationId
from tests.unit.builders import booted, service


def test_closing_a_stream_aborts_the_engine_request(demo_model: Path) -> None:
    async def main() -> None:
        hold = Hold(at=1)  # under way after its first token until the client leaves
        engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), hold=hold)
        await engine.start()
        metrics = Metrics()
        svc = service(booted([Replica(LocationId("replica-0"), engine)]), metrics)
        req = ChatCompletionRequest(
            model="vcache-demo",
            messages=[ChatMessage(role="user", content="hello")],
            max_tokens=50,
            stream=True,
        )
        routed = await svc.chat_stream(req, Principal(tenant="t"))
        first = await anext(routed.body)  # the role's chunk and the first piece's
        assert engine.stats().unfinished_requests == 1
        await routed.body.aclose()  # the client went away
        assert engine.aborted == [first[0].id]
        assert engine.stats().unfinished_requests == 0
        assert svc.dispatcher.replicas[0].inflight == 0
        text = metrics.render().decode()
        assert 'vcache_requests_aborted_total{endpoint="chat"} 1.0' in text

    asyncio.run(main())
