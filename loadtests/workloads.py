"""Seeded, pre-built load-test workloads (no tokenization happens inside users).

A workload is a list of sessions; a session is a list of turns that one user
sends in order (a multi-turn session appends the real answer of each turn
before the next question).  Sizes are in tokens of the served model: the
builder trims text with the model's tokenizer when one is given.

Every prompt opens with the run id, so a run measures the reuse inside it,
never what an earlier run left in the cache; the same seed and run id give
the same bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

VOCAB = (
    "cache block token model request answer system prompt value server client document "
    "question context replica prefix router latency memory engine batch kernel tensor "
    "shard anchor warm cold evict pin lease tenant salt hash index plan ledger"
).split()

CountTokens = Callable[[str], int]


@dataclass
class Turn:
    user: str
    max_tokens: int
    label: str  # e.g. "group-3", "turn-2", "doc-1"


@dataclass
class Session:
    system: str | None
    turns: list[Turn]
    think_time_s: float = 0.0
    start_s: float = 0.0  # not before this many seconds into the run (bursty schedules)


@dataclass
class Workload:
    name: str
    seed: int
    sessions: list[Session] = field(default_factory=list)

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @staticmethod
    def load(path: Path) -> Workload:
        raw = json.loads(path.read_text())
        sessions = [
            Session(
                s["system"], [Turn(**t) for t in s["turns"]], s["think_time_s"], s.get("start_s", 0)
            )
            for s in raw["sessions"]
        ]
        return Workload(raw["name"], raw["seed"], sessions)


def _opening(run_id: str) -> str:
    return f"[run {run_id}] "


def _text(rng: random.Random, tokens: int, count: CountTokens | None) -> str:
    """Text of about ``tokens`` tokens (exactly at most ``tokens`` when ``count`` is given)."""
    words = rng.choices(VOCAB, k=max(1, tokens))
    text = " ".join(words)
    if count is None:
        return text
    while len(words) > 1 and count(text) > tokens:
        words = words[: max(1, int(len(words) * tokens / count(text)) - 1)]
        text = " ".join(words)
    return text


def zipf_weights(n: int, s: float) -> list[float]:
    """Explicit Zipf(s) weights over ranks 1..n (any s >= 0, including s <= 1)."""
    raw = [i**-s for i in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def shared_prefix(
    groups: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    requests: int,
    skew: float,
    seed: int,
    run_id: str,
    count: CountTokens | None = None,
    volatile: bool = False,
) -> Workload:
    """``volatile``: each system prompt opens with a ``Current time: {now}`` line that the
    user fills in at send time (what a careless prompt template does)."""
    rng = random.Random(seed)
    head = "Current time: {now}\n" if volatile else ""
    systems = [head + _opening(run_id) + _text(rng, system_tokens, count) for _ in range(groups)]
    picks = rng.choices(range(groups), weights=zipf_weights(groups, skew), k=requests)
    sessions = [
        Session(systems[g], [Turn(_text(rng, question_tokens, count), output_tokens, f"group-{g}")])
        for g in picks
    ]
    return Workload("shared_prefix", seed, sessions)


def multi_turn(
    users: int,
    turns: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    think_time_s: float,
    seed: int,
    run_id: str,
    count: CountTokens | None = None,
) -> Workload:
    rng = random.Random(seed)
    sessions = [
        Session(
            _opening(run_id) + _text(rng, system_tokens, count),
            [
                Turn(_text(rng, question_tokens, count), output_tokens, f"turn-{t}")
                for t in range(turns)
            ],
            think_time_s,
        )
        for _ in range(users)
    ]
    return Workload("multi_turn", seed, sessions)


def long_document_qa(
    documents: int,
    document_tokens: int,
    questions: int,
    question_tokens: int,
    output_tokens: int,
    interleaved: bool,
    seed: int,
    run_id: str,
    count: CountTokens | None = None,
) -> Workload:
    rng = random.Random(seed)
    docs = [_opening(run_id) + _text(rng, document_tokens, count) for _ in range(documents)]
    pairs = [(d, k) for k in range(questions) for d in range(documents)]  # interleaved
    if not interleaved:
        rng.shuffle(pairs)
    sessions = [
        Session(docs[d], [Turn(_text(rng, question_tokens, count), output_tokens, f"doc-{d}")])
        for d, _ in pairs
    ]
    return Workload("long_document_qa", seed, sessions)


def zero_reuse(
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int,
    run_id: str,
    count: CountTokens | None = None,
) -> Workload:
    """Unique prompts: every one opens with a distinct nonce, so no block can be shared."""
    rng = random.Random(seed)
    sessions = [
        Session(
            None,
            [
                Turn(
                    f"{_opening(run_id)}nonce {i}: " + _text(rng, prompt_tokens, count),
                    output_tokens,
                    "unique",
                )
            ],
        )
        for i in range(requests)
    ]
    return Workload("zero_reuse", seed, sessions)


def bursty(
    anchors: int,
    anchor_tokens: int,
    skew: float,
    bursts: int,
    per_burst: int,
    gap_s: float,
    burst_s: float,
    seed: int,
    run_id: str,
) -> Workload:
    """Bursts of single-turn requests separated by idle gaps: burst ``b`` starts at
    ``b * gap_s`` seconds and spreads ``per_burst`` requests over ``burst_s``; each picks
    one of ``anchors`` system prompts (``anchor_tokens`` long) by Zipf(``skew``).  With
    gaps longer than a provider's TTL, every burst starts cold unless something keeps
    the anchors warm (the control-loop comparison)."""
    rng = random.Random(seed)
    systems = [
        f"{_opening(run_id)}anchor {a}\n" + _text(rng, anchor_tokens, None) for a in range(anchors)
    ]
    weights = zipf_weights(anchors, skew)
    sessions = []
    for b in range(bursts):
        for _ in range(per_burst):
            a = rng.choices(range(anchors), weights=weights)[0]
            start = b * gap_s + rng.uniform(0, burst_s)
            question = _text(rng, 12, None)
            sessions.append(Session(systems[a], [Turn(question, 4, f"anchor-{a}")], 0.0, start))
    sessions.sort(key=lambda s: s.start_s)
    return Workload("bursty", seed, sessions)
