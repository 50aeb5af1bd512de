"""Deterministic mode on a live server: two identical bursts of mixed requests, in different
orders, must give every seeded or greedy request the same text.

Starts `tokenmill serve --deterministic` on a checkpoint (default: the embedded demo model, with
its draft model, k = 3, on a pool of 40 pages of 8 tokens, so requests preempt each other), sends
the same requests twice (seeded sampled, greedy, unseeded; n = 2, stop strings, streams; a few
unseeded clients leave early), and prints how many of the compared requests differ. Exits 1 if
any does.

    PYTHONPATH=$PWD python scripts/determinism_burst.py
    PYTHONPATH=$PWD python scripts/determinism_burst.py --no-draft --server-arg=--num-pages=400
    PYTHONPATH=$PWD python scripts/determinism_burst.py --server-arg=--device=cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.server import MODEL_NAME, run_server
from tokenmill.config import DEMO_MODEL_DIR

WORDS = ("the", "model", "django", "python", "request", "view", "query", "field", "class", "import",
         "return", "value", "list")  # fmt: skip
DRAFT_DIR = DEMO_MODEL_DIR.parent / "demo-llama-2m-draft"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=80, help="Requests a burst (default: 80).")
    parser.add_argument(
        "--model-dir", default=str(DEMO_MODEL_DIR), help="Checkpoint to serve (default: demo)."
    )
    parser.add_argument(
        "--no-draft", action="store_true", help="No speculation (default: the demo's draft)."
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="Extra `serve` flag (repeatable)."
    )
    return parser.parse_args(argv)


def bodies(count: int) -> list[dict[str, Any]]:
    """The burst's requests, the same every time."""
    rng = random.Random(3)
    out = []
    for i in range(count):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(5, 60)))
        body: dict[str, Any] = {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": rng.randrange(20, 90),
            "temperature": 1.0, "top_p": 0.95, "seed": i, "ignore_eos": True,
        }  # fmt: skip
        if i % 7 == 0:
            body["n"] = 2
        if i % 5 == 1:
            body["stop"] = ["the"]
        if i % 3 == 2:
            body["stream"] = True
        if i % 6 == 4:
            body["temperature"] = 0.0
        if i % 8 == 3:
            del body["seed"]
        out.append(body)
    return out


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any], leave: bool):
    """The choices' texts by index; None for a client that leaves after 0.3 s."""
    if leave:
        with contextlib.suppress(httpx.TimeoutException):
            await client.post(url, json=body, timeout=0.3)
        return None
    if not body.get("stream"):
        response = await client.post(url, json=body, timeout=600)
        response.raise_for_status()
        return [c["text"] for c in response.json()["choices"]]
    texts: dict[int, str] = {}
    async with client.stream("POST", url, json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return [texts[k] for k in sorted(texts)]


async def burst(base_url: str, requests: list[dict[str, Any]], order_seed: int) -> dict:
    """Every request at once, in a shuffled order, a few ms apart; an unseeded tenth leave."""
    rng = random.Random(order_seed)
    order = rng.sample(range(len(requests)), len(requests))
    async with httpx.AsyncClient() as client:
        tasks = {}
        for i in order:
            leave = "seed" not in requests[i] and rng.random() < 0.3
            url = base_url + "/v1/completions"
            tasks[i] = asyncio.create_task(_send(client, url, requests[i], leave))
            await asyncio.sleep(rng.random() * 0.05)
        return {i: await task for i, task in tasks.items()}


def compared(body: dict[str, Any]) -> bool:
    """Requests whose text must not change: greedy ones and seeded ones."""
    return body["temperature"] == 0 or "seed" in body


async def main(ns: argparse.Namespace) -> int:
    flags = ["--dtype", "bfloat16", "--deterministic", "--num-pages", "40", "--page-size", "8",
             "--max-model-len", "256", "--max-num-seqs", "16"]  # fmt: skip
    if not ns.no_draft:
        spec = {"method": "draft_model", "model": str(DRAFT_DIR), "num_speculative_tokens": 3}
        flags += ["--speculative-config", json.dumps(spec)]
    requests = bodies(ns.requests)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with run_server(Path(ns.model_dir), log, *flags, *ns.server_arg) as server:
            first = await burst(server.base_url, requests, 1)
            second = await burst(server.base_url, requests, 2)
            metrics = httpx.get(server.base_url + "/metrics").text
    preemptions = next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("tokenmill:num_preemptions_total"))  # fmt: skip
    checked = [i for i, body in enumerate(requests) if compared(body)]
    differ = [i for i in checked if first[i] != second[i]]
    print(f"{len(differ)} of {len(checked)} seeded or greedy requests differ "
          f"({float(preemptions):.0f} preemptions): {differ}")  # fmt: skip
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
