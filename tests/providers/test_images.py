"""Images end to end (issue 47): the official ``openai`` and ``anthropic`` SDKs send images
through vcache to each provider's emulator; the emulator receives the bytes unchanged
(the sha256 of what it decoded is the sha256 of what the client sent), and a second
request with the same images reads them from the provider's cache, exactly as many
tokens as the emulator counted; other bytes of the same size are not read; an alias
whose first target cannot see skips it."""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import grpc
import openai
import pytest
from PIL import Image

from engines.tokenizer import ChatTokenizer
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from tests.providers.conftest import KEY, MANUAL, MODELS, Emulator, Gw, make_gateway


def png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), color).save(out, format="PNG")
    return out.getvalue()


def jpeg(w: int, h: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), (30, 90, 200)).save(out, format="JPEG", quality=80)
    return out.getvalue()


RED = png(600, 400, (220, 20, 20))
BLACK = png(600, 400, (0, 0, 0))  # the same size, other bytes
PHOTO = jpeg(320, 240)
PDF = b"%PDF-1.4\n1 0 obj<</Type/Catalog>>endobj\ntrailer<</Root 1 0 R>>\n%%EOF\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def gw(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    aliases = {"seeing": ["deepseek/deepseek-chat", "openai/gpt-5"]}
    yield from make_gateway(emulator, tokenizer, aliases=aliases)


def media(gw: Gw) -> list[dict[str, Any]]:
    return list(gw.emulator.admin_get("media"))


def reads(gw: Gw, provider: str) -> int:
    """Tokens the emulator served from its cache to ``provider``'s callers so far."""
    bill = gw.emulator.admin_get("billing").get(provider) or {}
    return int(bill.get("read") or 0)


def chat_turns(first: bytes, answer: str | None) -> list[Any]:
    """A system anchor, a user turn with two images; with ``answer``, the assistant's and
    a next question after it."""
    user = {
        "role": "user",
        "content": [
            {"type": "text", "text": "What differs between these?"},
            {
                "type": "image_url",
                "image_url": {"url": data_url(first, "image/png"), "detail": "high"},
            },
            {"type": "image_url", "image_url": {"url": data_url(PHOTO, "image/jpeg")}},
        ],
    }
    turns: list[Any] = [{"role": "system", "content": MANUAL}, user]
    if answer is not None:
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    return turns


@pytest.mark.parametrize("provider", ["anthropic", "openai", "gemini"])
def test_openai_sdk_images_reach_each_provider_unchanged_and_are_read_back(
    gw: Gw, provider: str
) -> None:
    model = f"{provider}/{MODELS[provider]}"
    client = gw.client()
    first = client.chat.completions.create(
        model=model, messages=chat_turns(RED, None), max_tokens=8
    )
    assert first.choices[0].message.content
    seen = media(gw)
    assert [m["sha256"] for m in seen] == [sha(RED), sha(PHOTO)]  # bytes as sent
    if provider == "openai":
        assert [m["detail"] for m in seen] == ["high", None]
    answer = first.choices[0].message.content or ""
    before = reads(gw, provider)
    second = client.chat.completions.create(
        model=model, messages=chat_turns(RED, answer), max_tokens=8
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached and cached > 0
    assert cached == reads(gw, provider) - before  # what the emulator served from its cache
    assert [m["sha256"] for m in media(gw)[2:]] == [sha(RED), sha(PHOTO)]
    st = gw.stats()[model]  # the ledger credits exactly what the provider served
    assert (st["credited_tokens"], st["unverified_tokens"], st["false_warm"]) == (cached, 0, 0)
    if provider == "gemini":
        return  # its cached content for the anchor changes what the next one reads
    before = reads(gw, provider)
    other = client.chat.completions.create(
        model=model, messages=chat_turns(BLACK, answer), max_tokens=8
    )
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    read = other.usage.prompt_tokens_details.cached_tokens or 0
    assert read == reads(gw, provider) - before
    image_tokens = media(gw)[-2]["tokens"]
    assert read <= cached - image_tokens  # read up to the changed image, not through it
    st = gw.stats()[model]  # never credited past what was served (a read that ends
    # inside a message, before its changed image, is credited to the segment before it)
    assert cached <= st["credited_tokens"] <= cached + read and st["false_warm"] == 0


def sdk(gw: Gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key=KEY, http_client=gw.http, max_retries=0
    )


def test_anthropic_sdk_image_and_document_blocks_with_a_breakpoint(gw: Gw) -> None:
    image = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(RED).decode(),
        },
        "cache_control": {"type": "ephemeral"},
    }
    doc = {
        "type": "document",
        "source": {
            "type": "base64",
            "media_type": "application/pdf",
            "data": base64.b64encode(PDF).decode(),
        },
        "title": "spec.pdf",
    }
    turn: Any = {"role": "user", "content": [{"type": "text", "text": "Read both."}, doc, image]}
    kw: Any = {"model": "anthropic/claude-sonnet-4-5", "max_tokens": 8, "system": MANUAL}
    first = sdk(gw).messages.create(messages=[turn], **kw)
    assert first.usage.cache_creation_input_tokens and first.usage.cache_read_input_tokens == 0
    assert [m["sha256"] for m in media(gw)] == [sha(PDF), sha(RED)]
    sent = gw.emulator.last_body()["messages"][0]["content"]
    assert sent[2]["cache_control"]["type"] == "ephemeral"  # the client's breakpoint, on it
    assert sent[1]["title"] == "spec.pdf"
    before = reads(gw, "anthropic")
    follow: Any = [
        turn,
        {"role": "assistant", "content": first.content[0].text if first.content else "ok"},
        {"role": "user", "content": "Now summarise."},
    ]
    second = sdk(gw).messages.create(messages=follow, **kw)
    read = second.usage.cache_read_input_tokens or 0
    assert read > 0 and read == reads(gw, "anthropic") - before
    assert read >= first.usage.cache_creation_input_tokens  # through the image


def test_responses_input_image_reaches_openai_unchanged(gw: Gw) -> None:
    client = gw.client()
    r = client.responses.create(
        model="openai/gpt-5",
        instructions=MANUAL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {
                        "type": "input_image",
                        "image_url": data_url(PHOTO, "image/jpeg"),
                        "detail": "low",
                    },
                ],
            }
        ],
        max_output_tokens=8,
    )
    assert r.output_text
    seen = media(gw)
    assert [(m["sha256"], m["detail"], m["tokens"]) for m in seen] == [(sha(PHOTO), "low", 85)]


def test_an_image_bearing_call_skips_a_target_that_cannot_see(gw: Gw) -> None:
    client = gw.client()
    text = client.chat.completions.with_raw_response.create(
        model="seeing", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert text.headers["x-vcache-target"] == "deepseek/deepseek-chat"
    seeing = client.chat.completions.with_raw_response.create(
        model="seeing", messages=chat_turns(RED, None), max_tokens=4
    )
    assert seeing.headers["x-vcache-target"] == "openai/gpt-5"
    deepseek = [r for r in gw.emulator.received() if r["provider"] == "deepseek"]
    assert len(deepseek) == 1  # the text call only: the image was never offered to it
    assert [m["sha256"] for m in media(gw)] == [sha(RED), sha(PHOTO)]


def test_grpc_image_bytes_reach_the_provider_unchanged(
    emulator: Emulator, tokenizer: ChatTokenizer
) -> None:
    emulator.admin("reset")
    for gw in make_gateway(emulator, tokenizer, grpc_port=0):
        port = gw.http.app.state.grpc.port  # type: ignore[attr-defined]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GatewayStub(channel)
            image = pb.Image(data=RED, media_type="image/png", detail="low")
            parts = [pb.ContentPart(text="What is it?"), pb.ContentPart(image=image)]
            request = pb.ChatCompletionRequest(
                model="openai/gpt-5",
                messages=[
                    pb.ChatMessage(role="system", content=MANUAL),
                    pb.ChatMessage(role="user", parts=parts),
                ],
                sampling=pb.SamplingParams(max_tokens=4),
            )
            auth = (("authorization", f"Bearer {KEY}"),)
            r = stub.ChatCompletion(request, metadata=auth)
            assert r.usage.target == "openai/gpt-5"
            assert [(m["sha256"], m["detail"]) for m in media(gw)] == [(sha(RED), "low")]
            both = pb.ChatMessage(role="user", content="x", parts=parts)
            bad = pb.ChatCompletionRequest(model="openai/gpt-5", messages=[both])
            with pytest.raises(grpc.RpcError) as err:
                stub.ChatCompletion(bad, metadata=auth)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "messages[0]" in (err.value.details() or "")
            fake = pb.ContentPart(image=pb.Image(data=b"not a png", media_type="image/png"))
            lying = pb.ChatMessage(role="user", parts=[parts[0], fake])
            with pytest.raises(grpc.RpcError) as err:
                stub.ChatCompletion(
                    pb.ChatCompletionRequest(model="openai/gpt-5", messages=[lying]),
                    metadata=auth,
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith("messages[0].parts[1]:")


def test_previous_response_id_carries_the_image_from_the_store(gw: Gw) -> None:
    client = gw.client()
    image = {"type": "input_image", "image_url": data_url(RED, "image/png"), "detail": "high"}
    turn: Any = {"role": "user", "content": [{"type": "input_text", "text": "See?"}, image]}
    first = client.responses.create(
        model="openai/gpt-5",
        instructions=MANUAL,
        input=[turn],
        max_output_tokens=8,
    )
    second = client.responses.create(
        model="openai/gpt-5",
        instructions=MANUAL,
        previous_response_id=first.id,
        input="And now?",
        max_output_tokens=8,
    )
    # the history's image, rebuilt from the attachments store, went again byte for byte
    assert [(m["sha256"], m["detail"]) for m in media(gw)] == [(sha(RED), "high")] * 2
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0


@functools.cache
def screenshot(n: int) -> bytes:
    """The n-th screenshot: noise PNG compresses no better than a real screen's detail
    (its base64 is hundreds of times what a provider counts for it), the same each time
    it is asked for."""
    pixels = bytes((i * 7919 + n * 31) % 251 for i in range(320 * 200 * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (320, 200), pixels).save(out, format="PNG")
    return out.getvalue()


def agent_turns(upto: int, answers: list[str]) -> list[Any]:
    """An agent's conversation through turn ``upto``: a screenshot in every fifth turn;
    after the tenth, every screenshot but the latest stripped (replaced by a note)."""
    out: list[Any] = [{"role": "system", "content": MANUAL}]
    shots = [i for i in range(upto + 1) if i % 5 == 0]
    for i in range(upto + 1):
        content: list[Any] = [{"type": "text", "text": f"Step {i}: what next?"}]
        if i in shots:
            if upto > 10 and i != shots[-1]:
                content.append({"type": "text", "text": "[screenshot removed]"})
            else:
                url = data_url(screenshot(i), "image/png")
                content.append({"type": "image_url", "image_url": {"url": url}})
        out.append({"role": "user", "content": content})
        if i < upto:
            out.append({"role": "assistant", "content": answers[i]})
    return out


@pytest.mark.parametrize("provider", ["anthropic", "openai", "gemini"])
def test_agent_screenshots_stripped_credit_exactly_what_was_served(gw: Gw, provider: str) -> None:
    """A screenshot every fifth turn, the older ones stripped after the tenth: each read is
    what the emulator served, and the ledger credits all of it, verified."""
    model = f"{provider}/{MODELS[provider]}"
    client = gw.client()
    answers: list[str] = []
    served = 0
    for turn in range(15):
        before = reads(gw, provider)
        c = client.chat.completions.create(
            model=model, messages=agent_turns(turn, answers), max_tokens=6
        )
        answers.append(c.choices[0].message.content or "ok")
        assert c.usage is not None and c.usage.prompt_tokens_details is not None
        cached = c.usage.prompt_tokens_details.cached_tokens or 0
        assert cached == reads(gw, provider) - before
        served += cached
    st = gw.stats()[model]
    assert st["cached_tokens"] == served > 0
    assert (st["credited_tokens"], st["unverified_tokens"], st["false_warm"]) == (served, 0, 0)


class _Images(http.server.BaseHTTPRequestHandler):
    """Serves RED at /red.png, a 404 elsewhere."""

    def do_GET(self) -> None:
        if self.path != "/red.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(RED)))
        self.end_headers()
        self.wfile.write(RED)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def image_host() -> Iterator[str]:
    """An image server on loopback: its host:port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_urls_only_from_allowed_hosts_and_bad_bytes_refused_by_name(
    emulator: Emulator, tokenizer: ChatTokenizer, image_host: str
) -> None:
    emulator.admin("reset")
    for gw in make_gateway(emulator, tokenizer, attachments={"fetch_hosts": [image_host]}):
        url = f"http://{image_host}/red.png"
        block: Any = {"type": "image", "source": {"type": "url", "url": url}}
        turn: Any = {"role": "user", "content": [{"type": "text", "text": "Look."}, block]}
        kw: Any = {"model": "anthropic/claude-sonnet-4-5", "max_tokens": 8, "system": MANUAL}
        sdk(gw).messages.create(messages=[turn], **kw)
        # fetched by the gateway, sent on as its bytes: the emulator decoded exactly them
        assert [m["sha256"] for m in media(gw)] == [sha(RED)]
        sent = gw.emulator.last_body()["messages"][0]["content"][1]["source"]
        assert sent["type"] == "base64" and base64.b64decode(sent["data"]) == RED
        elsewhere = "http://images.example.com/red.png"
        parts: Any = [
            {"type": "text", "text": "Look."},
            {"type": "image_url", "image_url": {"url": elsewhere}},
        ]
        with pytest.raises(openai.BadRequestError) as err:
            gw.client().chat.completions.create(
                model="openai/gpt-5", messages=[{"role": "user", "content": parts}]
            )
        assert "images.example.com" in str(err.value) and "messages[0].content[1]" in str(err.value)
        corrupt: Any = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K!!"},
        }
        with pytest.raises(anthropic.BadRequestError) as refused:
            sdk(gw).messages.create(messages=[{"role": "user", "content": [corrupt]}], **kw)
        # named as the client sent it (the system prompt is chat's messages[0])
        assert "messages.0.content.0: the data URL's base64 is corrupt" in str(refused.value)
        lying = base64.b64encode(PHOTO).decode()  # JPEG bytes declared as PNG
        wrong: Any = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": lying},
        }
        with pytest.raises(anthropic.BadRequestError):
            sdk(gw).messages.create(messages=[{"role": "user", "content": [wrong]}], **kw)
        bad = {"type": "input_image", "image_url": "data:image/png;base64,@@"}
        said: Any = {"role": "user", "content": [{"type": "input_text", "text": "x"}, bad]}
        with pytest.raises(openai.BadRequestError) as refused_r:
            gw.client().responses.create(
                model="openai/gpt-5",
                instructions=MANUAL,
                input=[said],
            )
        assert "input[0].content[1]" in str(refused_r.value)
        assert len(media(gw)) == 1  # none of the refused reached a provider
        assert (
            gw.client()
            .chat.completions.create(
                model="openai/gpt-5", messages=[{"role": "user", "content": "still up?"}]
            )
            .choices
        )  # the gateway unharmed


@pytest.mark.parametrize("provider", ["anthropic", "openai", "gemini"])
def test_streamed_answers_carry_images_too(gw: Gw, provider: str) -> None:
    model = f"{provider}/{MODELS[provider]}"
    stream = gw.client().chat.completions.create(
        model=model,
        messages=chat_turns(RED, None),
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    assert [m["sha256"] for m in media(gw)] == [sha(RED), sha(PHOTO)]
    last = gw.emulator.received()[-1]["path"]
    if provider == "gemini":
        assert last.endswith(":streamGenerateContent")
    else:
        assert gw.emulator.last_body()["stream"] is True
