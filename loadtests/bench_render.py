"""What rendering a chat prompt costs the event loop: on it, or on the render thread.

The gateway renders every chat prompt through the model's chat template and
tokenizes it (``gateway/service/render_thread.py``).  For coding-agent
prompts of ``--sizes`` tokens (a system prompt, tool schemas, turns of tool
results), renders run back to back for ``--seconds`` each way: on the event
loop (as the gateway did before the render thread) and on the render thread;
meanwhile a ticker on the loop asks to wake every ``--tick-ms`` and records
how late it woke (what any other request waits: its first token, its stream).
The target: with the render thread, the loop's worst lateness stays under
``--max-lag-ms`` at every size.  Prints a table, writes JSON, exits 1 when the
target is missed.

    python -m loadtests.bench_render --sizes 2000 15000 50000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engines.tokenizer import ChatTokenizer
from gateway.service.render_thread import RenderThread

WORDS = "cache block prefix anchor tenant replica token span warm pin lease evict".split()
TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}


def agent_prompt(tok: ChatTokenizer, tokens: int, seed: int = 7) -> list[dict[str, Any]]:
    """An agent's conversation of about ``tokens`` tokens: system, then tool turns."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    def turn(i: int) -> list[dict[str, Any]]:
        call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
        }
        return [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": text(150)},
        ]

    messages: list[dict[str, Any]] = [{"role": "system", "content": text(300)}]
    messages.append({"role": "user", "content": "fix the failing test"})
    base = len(tok.render_chat(messages, [TOOL]))
    per_turn = len(tok.render_chat(messages + turn(0), [TOOL])) - base
    for i in range(max(0, round((tokens - base) / per_turn))):
        messages += turn(i)
    return messages


def _ways(
    tok: ChatTokenizer, renders: RenderThread, messages: list[dict[str, Any]]
) -> list[tuple[str, Callable[[], Any]]]:
    """Rendering ``messages`` on the event loop, and on the render thread."""

    async def on_loop() -> list[int]:
        return tok.render_chat(messages, [TOOL])

    async def on_thread() -> list[int]:
        return await renders.run(tok, lambda own: own.render_chat(messages, [TOOL]))

    return [("loop", on_loop), ("thread", on_thread)]


async def _measure(render: Callable[[], Any], seconds: float, tick_ms: float) -> dict[str, float]:
    lags: list[float] = []
    stop = False

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop:
            due = loop.time() + tick_ms / 1000
            await asyncio.sleep(tick_ms / 1000)
            lags.append(max(0.0, loop.time() - due) * 1000)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await render()
        times.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(0)
    stop = True
    await task
    lags.sort()
    return {
        "renders": len(times),
        "render_ms": statistics.fmean(times),
        "lag_p50_ms": lags[len(lags) // 2],
        "lag_p99_ms": lags[min(len(lags) - 1, int(len(lags) * 0.99))],
        "lag_max_ms": lags[-1],
    }


async def run(tok: ChatTokenizer, sizes: list[int], seconds: float, tick_ms: float) -> list[Any]:
    renders = RenderThread()
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes:
            messages = agent_prompt(tok, size)
            n = len(tok.render_chat(messages, [TOOL]))
            for way, render in _ways(tok, renders, messages):
                got = await _measure(render, seconds, tick_ms)
                rows.append({"tokens": n, "way": way, **got})
    finally:
        renders.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'tokens':>7} {'way':<7} {'renders':>7} {'ms/render':>9} "
        f"{'lag p50':>8} {'p99':>7} {'max':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r['tokens']:>7} {r['way']:<7} {r['renders']:>7} {r['render_ms']:>9.1f} "
            f"{r['lag_p50_ms']:>8.1f} {r['lag_p99_ms']:>7.1f} {r['lag_max_ms']:>7.1f}"
        )
    return "\n".join(lines)


def missed(rows: list[dict[str, Any]], max_lag_ms: float) -> list[int]:
    """The sizes whose loop, renders on the thread, woke later than ``max_lag_ms``."""
    return [r["tokens"] for r in rows if r["way"] == "thread" and r["lag_max_ms"] > max_lag_ms]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000, 15000, 50000])
    ap.add_argument("--seconds", type=float, default=5.0, help="of renders, per size and way")
    ap.add_argument("--tick-ms", type=float, default=5.0)
    ap.add_argument("--max-lag-ms", type=float, default=20.0)
    ap.add_argument("--data-dir", default=".vcache-test-data", help="where the demo model is")
    ap.add_argument("--model", default=None, help="a tokenizer path or hub id (else the demo)")
    ap.add_argument("--out", default="bench-render.json")
    args = ap.parse_args()
    if args.model is None:
        from engines.vllm.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model(Path(args.data_dir)))
    tok = ChatTokenizer.from_pretrained(args.model)
    rows = asyncio.run(run(tok, args.sizes, args.seconds, args.tick_ms))
    print(table(rows))
    late = missed(rows, args.max_lag_ms)
    verdict = f"MISSED at {late} tokens" if late else "met"
    print(
        f"target: the loop's worst lateness under {args.max_lag_ms:g} ms with the render "
        f"thread: {verdict}"
    )
    result = {"rows": rows, "max_lag_ms": args.max_lag_ms, "missed": late}
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 1 if late else 0


if __name__ == "__main__":
    sys.exit(main())
