"""A gRPC ``Completion`` goes through the same request path as ``/v1/completions``: it is
journaled (verified before it is sent) and rebuilds from the session log byte for
byte."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from gateway.sessions.log import SessionLog
from gateway.sessions.render import vllm_payload
from tests.settings import gateway_settings

KEY = "sk-grpc-user"
AUTH = (("authorization", f"Bearer {KEY}"),)


def test_a_grpc_completion_is_journaled_and_rebuilds(demo_model: Path) -> None:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512)
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="u", name="user")]
    app = create_app(gateway_settings(api_keys=keys, grpc_port=0), [engine])
    with TestClient(app), grpc.insecure_channel(f"127.0.0.1:{app.state.grpc.port}") as ch:
        stub = pb_grpc.GatewayStub(ch)
        log: SessionLog = app.state.session_log
        for prompt in ({"text": "a prompt over gRPC"}, {"token_ids": pb.TokenIds(ids=[5, 6, 7])}):
            sampling = pb.SamplingParams(max_tokens=2)
            r = stub.Completion(
                pb.CompletionRequest(model="vcache-demo", sampling=sampling, **prompt),
                metadata=AUTH,
            )
            g = engine.received[-1]
            assert g.request_id == r.id
            row = log.store.request(r.id)
            assert row is not None
            _, rebuilt = log.rebuild(row.session_id, row.seq)
            sampled = dataclasses.asdict(g.sampling)
            assert rebuilt == vllm_payload(g.prompt_token_ids, g.cache_salt, sampled)
        assert log.verified == 2
