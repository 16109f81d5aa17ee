"""The journal's record of a request's sampling options is exactly what
``dataclasses.asdict`` made of them (the log's bytes must not move), for any options."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from engines.base import SamplingOptions, Structured
from gateway.service.engine_request import sampling_record
from manifest.canonical import canonical_json

texts = st.text(max_size=8)
ids = st.integers(min_value=0, max_value=150_000)
structured = st.builds(
    Structured,
    json_schema=st.none() | texts,
    json_object=st.booleans(),
    regex=st.none() | texts,
    choice=st.none() | st.tuples(texts, texts),
    any_whitespace=st.booleans(),
)
options = st.builds(
    SamplingOptions,
    max_tokens=st.integers(min_value=0, max_value=4096),
    temperature=st.floats(min_value=0, max_value=2),
    top_k=st.integers(min_value=0, max_value=50),
    stop=st.lists(texts, max_size=3).map(tuple),
    seed=st.none() | st.integers(),
    n=st.integers(min_value=1, max_value=4),
    logprobs=st.none() | st.integers(min_value=0, max_value=5),
    structured=st.none() | structured,
    logit_bias=st.lists(st.tuples(ids, st.floats(-100, 100)), max_size=3).map(tuple),
    stop_token_ids=st.lists(ids, max_size=3).map(tuple),
    bad_words=st.lists(texts, max_size=2).map(tuple),
    allowed_token_ids=st.none() | st.lists(ids, max_size=3).map(tuple),
    stream_interval=st.none() | st.integers(min_value=1, max_value=8),
)


@given(options)
def test_the_record_is_asdicts(s: SamplingOptions) -> None:
    record = sampling_record(s)
    assert record == dataclasses.asdict(s)
    assert canonical_json(record) == canonical_json(dataclasses.asdict(s))
