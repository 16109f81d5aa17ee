"""One image's tokens and its CPU prefill, cold and warm, on the local vision model.

    .venv/bin/python -m loadtests.vision_prefill --out /tmp/vision-prefill

Starts ``vcache serve --demo vision`` (one replica) and, for each image size in
``--sizes``, ``--repeats`` times with an image of its own (fresh pixels, so fresh
blocks) behind a system prompt of its own:

- the image's tokens: ``/tokenize`` of a user turn with the image after its text,
  less the same turn without it (the placeholders vLLM's processor expands it to);
- cold: the system prompt, the image and a question, one output token: nothing cached;
- warm: the same with another question: everything through the image read from cache.

Per request the client's end-to-end time and the gateway's TTFT phases for it
(``vcache_ttft_phase_seconds``, read from ``/metrics`` before and after:
``submit`` is the engine client's input processing, the image's pixels among it;
``prefill`` the engine core's steps to the first token, the vision tower's
encoding among them).  Prints the medians per size and writes
``vision_prefill.json``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.procs import free_port, get_ok, serving
from loadtests.report import parse_metrics

MODEL = "demo-vision"
PHASES = ("submit", "prefill")
SYSTEM = "You look at screenshots and say what is on them, briefly. "


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of ``width`` x ``height`` whose pixels depend on ``seed``."""
    from PIL import Image

    rnd = random.Random(seed)
    img = Image.new("RGB", (width, height), (rnd.randrange(256), 80, 160))
    for _ in range(200):
        img.putpixel((rnd.randrange(width), rnd.randrange(height)), (255, rnd.randrange(256), 0))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def image_part(data: bytes) -> dict[str, Any]:
    url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def image_tokens(c: httpx.Client, data: bytes) -> int:
    """The tokens the image adds to a prompt: its placeholders as vLLM expands them."""
    text = {"type": "text", "text": "What is it?"}

    def count(parts: list[dict[str, Any]]) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
        r = c.post("/tokenize", json=body)
        r.raise_for_status()
        return int(r.json()["count"])

    return count([text, image_part(data)]) - count([text])


def phase_seconds(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each phase's seconds between two scrapes of ``/metrics`` around one request."""
    out: dict[str, float] = {}
    for phase in PHASES:
        key = f'vcache_ttft_phase_seconds_sum{{phase="{phase}"'
        out[phase] = sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(key))
    return out


def one(c: httpx.Client, system: str, data: bytes, question: str) -> dict[str, Any]:
    """One request of one output token: its tokens, cached tokens and times."""
    before = parse_metrics(c.get("/metrics").text)
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [image_part(data), {"type": "text", "text": question}]},
        ],
    }
    t0 = time.perf_counter()
    r = c.post("/v1/chat/completions", json=body)
    e2e = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    after = parse_metrics(c.get("/metrics").text)
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "predicted": int(r.headers.get("x-vcache-predicted-cached-tokens", -1)),
        "e2e_s": e2e,
        **{f"{p}_s": s for p, s in phase_seconds(before, after).items()},
    }


def measure(url: str, sizes: list[tuple[int, int]], repeats: int, run: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=300) as c:
        one(c, f"{run} warm-up. " + SYSTEM, png(64, 64, 0), "Hi?")  # first-request costs
        for w, h in sizes:
            cold: list[dict[str, Any]] = []
            warm: list[dict[str, Any]] = []
            tokens = 0
            for k in range(repeats):
                data = png(w, h, w * 7919 + h * 31 + k)
                tokens = image_tokens(c, data)
                system = f"{run} {w}x{h} #{k}. " + SYSTEM
                cold.append(one(c, system, data, "What is on the screen?"))
                warm.append(one(c, system, data, "Which button is highlighted?"))
            row = {"size": f"{w}x{h}", "image_tokens": tokens, "cold": cold, "warm": warm}
            rows.append(row)
            print(line(row), flush=True)
    return rows


def _median(reqs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in reqs)


def line(row: dict[str, Any]) -> str:
    cold, warm = row["cold"], row["warm"]
    cells = [
        f"{row['size']:>10}",
        f"{row['image_tokens']:>7}",
        f"{int(_median(cold, 'prompt_tokens')):>7}",
        f"{int(_median(warm, 'cached_tokens')):>7}",
    ]
    for reqs in (cold, warm):
        cells += [f"{1000 * _median(reqs, k):>8.1f}" for k in ("e2e_s", "submit_s", "prefill_s")]
    return " ".join(cells)


HEADER = (
    f"{'image':>10} {'img tok':>7} {'prompt':>7} {'cached':>7} "
    + " ".join(
        f"{t:>8}" for t in ("cold e2e", "submit", "prefill", "warm e2e", "submit", "prefill")
    )
    + "   (ms, medians)"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/vcache-vision-prefill"))
    ap.add_argument("--data-dir", type=Path, default=None, help="default: <out>/data")
    ap.add_argument(
        "--sizes",
        default="64x64,320x240,640x400,1280x720,1920x1080,1600x200,200x900",
        help="comma-separated WxH",
    )
    ap.add_argument("--repeats", type=int, default=3, help="images of their own per size")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [(int(w), int(h)) for w, h in (s.split("x") for s in args.sizes.split(","))]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--demo",
        "vision",
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--replicas",
        "1",
        "--data-dir",
        str(args.data_dir or args.out / "data"),
    ]
    with serving(cmd, lambda: get_ok(f"{url}/readyz"), args.out / "gateway.log"):
        print(HEADER, flush=True)
        rows = measure(url, sizes, args.repeats, f"run {time.time_ns()}")
    (args.out / "vision_prefill.json").write_text(json.dumps(rows, indent=2))
    exact = all(r["predicted"] == r["cached_tokens"] for row in rows for r in row["warm"])
    print(f"every warm prediction exact: {exact}; {args.out / 'vision_prefill.json'}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
