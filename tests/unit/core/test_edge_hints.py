"""Another API's hints on a chat request: a new request, the wire model untouched."""

from __future__ import annotations

from gateway.core.schemas import ChatCompletionRequest, ChatMessage, EdgeHints


def _chat() -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[ChatMessage(role="user", content="hi")])


def test_hints_make_a_new_request_and_leave_the_old_one_as_it_was() -> None:
    req = _chat()
    hinted = req.with_hints(EdgeHints(top_k=5, clamp_output=True))
    assert hinted is not req
    assert hinted.hints == EdgeHints(top_k=5, clamp_output=True)
    assert req.hints == EdgeHints()  # the request as sent keeps no hints
    assert hinted.model_dump() == req.model_dump()  # never on the wire


def test_hints_ride_on_copies_of_the_hinted_request() -> None:
    hinted = _chat().with_hints(EdgeHints(effort="low"))
    named = hinted.model_copy(update={"model": "local"})
    assert named.hints.effort == "low" and named.model == "local"
