"""``python -m loadtests.emulator --port N``"""

from __future__ import annotations

import argparse

import uvicorn

from .app import create_app
from .state import EmulatorState


def main() -> None:
    p = argparse.ArgumentParser(description="vcache provider emulator")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8900)
    p.add_argument("--shards", type=int, default=4, help="cache shards per provider")
    p.add_argument("--capacity", type=int, default=4096, help="prefix entries per shard (LRU)")
    p.add_argument("--api-key", default=None, help="accept only this key (default: any)")
    a = p.parse_args()
    state = EmulatorState(shards=a.shards, capacity=a.capacity, api_key=a.api_key)
    uvicorn.run(create_app(state), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
