"""``python -m loadtests.emulator --port N``"""

from __future__ import annotations

import argparse

import uvicorn

from .app import create_app
from .batch_book import BatchBook, BatchRules
from .state import Clock, EmulatorState


def main() -> None:
    p = argparse.ArgumentParser(description="vcache provider emulator")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8900)
    p.add_argument("--shards", type=int, default=4, help="cache shards per provider")
    p.add_argument("--capacity", type=int, default=4096, help="prefix entries per shard (LRU)")
    p.add_argument("--api-key", default=None, help="accept only this key (default: any)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the emulator's clock runs this many times faster than real time (TTLs, "
        "rate-limit windows): a load test plays hours in minutes",
    )
    p.add_argument(
        "--answer-words",
        type=int,
        default=12,
        help="words in an answer when the request's output limit allows (a long streamed "
        "answer: many events)",
    )
    p.add_argument(
        "--batch-delay",
        type=float,
        default=1.0,
        help="emulator seconds from a batch's creation until its items are answered",
    )
    a = p.parse_args()
    state = EmulatorState(
        clock=Clock(a.time_scale),
        shards=a.shards,
        capacity=a.capacity,
        api_key=a.api_key,
        answer_words=a.answer_words,
        batch_book=BatchBook(BatchRules(delay_s=a.batch_delay)),
    )
    uvicorn.run(create_app(state), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
