"""A load run that accounts for every request: completed, aborted by its client, or rejected.

Used by the reliability tests (a bounded run) and by `scripts/load_test.py` and `scripts/soak.py`
(long ones). Requests mix streamed and non-streamed completions, some with `n` > 1; a fraction of
clients disconnect early (a stream closed after its first chunk, a plain request cancelled after
a moment), which the server must see as aborts. Each request also takes each of the load's
`features` with probability `feature_fraction`: the chat route, random sampling (temperature,
top-p/top-k, a seed, penalties, `min_tokens`), logprobs, stop strings, JSON output
(`response_format`, a grammar), echo (non-streamed completions), a tool (chat requests without
JSON output; `tool_choice` required, a grammar of its call, or auto). After the run the server's own
counters must agree: nothing left running or waiting, and as many engine requests finished
normally as the clients received.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

# What one request's client saw.
COMPLETED, DISCONNECTED, REJECTED, SERVER_ERROR, LOST = (
    "completed",
    "disconnected",
    "rejected",
    "server_error",
    "lost",
)


# What a request may use besides a plain completion (`LoadSpec.features`).
FEATURES = ("chat", "sampling", "logprobs", "stop", "json", "echo", "tools")
# The function a "tools" chat request offers (required half the time: a grammar of its call).
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@dataclass(frozen=True)
class LoadSpec:
    """How much load, and of what shape (`features`: comma-separated, of `FEATURES`)."""

    num_requests: int = field(default=200, metadata={"help": "Requests in all."})
    concurrency: int = field(default=64, metadata={"help": "Requests in flight at once."})
    disconnect_fraction: float = field(
        default=0.1, metadata={"help": "Share of clients that leave before their answer."}
    )
    max_tokens: int = field(
        default=16, metadata={"help": "A request's max_tokens is drawn from 1 to this."}
    )
    max_n: int = field(default=2, metadata={"help": "A request's n is drawn from 1 to this."})
    seed: int = field(default=0, metadata={"help": "Seed of the requests' plans."})
    timeout_s: float = field(default=300.0, metadata={"help": "Client timeout per request."})
    features: str = field(
        default=",".join(FEATURES),
        metadata={"help": f"Comma-separated request features, of: {', '.join(FEATURES)}."},
    )
    feature_fraction: float = field(
        default=0.25, metadata={"help": "Probability that a request takes each feature."}
    )

    def __post_init__(self) -> None:
        unknown = set(self.feature_list) - set(FEATURES)
        if unknown:
            raise ValueError(f"features: unknown {sorted(unknown)}; known: {', '.join(FEATURES)}")
        if not 0.0 <= self.feature_fraction <= 1.0:
            raise ValueError(f"feature_fraction must be in [0, 1], got {self.feature_fraction}")

    @property
    def feature_list(self) -> list[str]:
        """The features, as a list."""
        return [f for f in self.features.split(",") if f]


@dataclass
class LoadReport:
    """Every request's outcome, and whether the server's counters agree."""

    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    finished_choices: int = 0  # choices the clients saw end with "stop" or "length"
    disconnected_choices: int = 0  # choices of the requests whose clients left early
    server_finished: dict[str, int] = field(default_factory=dict)  # engine counters, this run
    server_idle: bool = False  # nothing running or waiting once the run was over
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # a sample of what went wrong

    @property
    def accounted(self) -> bool:
        """Every request completed, disconnected or rejected with a status; no 5xx but 503."""
        return self.outcomes[LOST] == 0 and self.outcomes[SERVER_ERROR] == 0

    @property
    def server_agrees(self) -> bool:
        """The engine is idle, finished normally every choice a client received (and at most
        those a client left early besides), and aborted none but those."""
        normal = self.server_finished.get("stop", 0) + self.server_finished.get("length", 0)
        aborted = self.server_finished.get("abort", 0)
        return (
            self.server_idle
            and self.finished_choices <= normal <= self.finished_choices + self.disconnected_choices
            and aborted <= self.disconnected_choices
        )

    @property
    def ok(self) -> bool:
        return self.accounted and self.server_agrees

    def summary(self) -> dict[str, Any]:
        return {
            "outcomes": dict(self.outcomes),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "finished_choices": self.finished_choices,
            "disconnected_choices": self.disconnected_choices,
            "server_finished": self.server_finished,
            "server_idle": self.server_idle,
            "seconds": round(self.seconds, 2),
            "accounted": self.accounted,
            "server_agrees": self.server_agrees,
            "errors": self.errors[:10],
        }


async def run_load(base_url: str, model: str, spec: LoadSpec) -> LoadReport:
    """Send `spec.num_requests` requests, `spec.concurrency` at a time; see the module doc."""
    rng = random.Random(spec.seed)
    report = LoadReport()
    limits = httpx.Limits(max_connections=spec.concurrency)
    client = httpx.AsyncClient(base_url=base_url, timeout=spec.timeout_s, limits=limits)
    async with client:
        before = await _finished(client)
        start = time.monotonic()
        semaphore = asyncio.Semaphore(spec.concurrency)

        async def one(plan: dict[str, Any]) -> None:
            async with semaphore:
                await _request(client, model, plan, report)

        await asyncio.gather(*(one(_plan(rng, spec)) for _ in range(spec.num_requests)))
        report.seconds = time.monotonic() - start
        report.server_idle = await _wait_idle(client)
        after = await _finished(client)
        report.server_finished = {k: v - before.get(k, 0) for k, v in after.items()}
    return report


# A client that will leave asks for this many times `max_tokens`, so that its request is still
# running when it leaves (a short one could finish first on a fast engine, and the abort path
# would go untested); it leaves early, so the long request costs little.
LEAVER_TOKENS_FACTOR = 10


def _plan(rng: random.Random, spec: LoadSpec) -> dict[str, Any]:
    plan = {
        "stream": rng.random() < 0.5,
        "n": rng.randint(1, spec.max_n),
        "max_tokens": rng.randint(1, spec.max_tokens),
        "prompt": " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(8)),
        "disconnect": rng.random() < spec.disconnect_fraction,
        "features": {f for f in spec.feature_list if rng.random() < spec.feature_fraction},
        "seed": rng.randrange(1 << 31),
    }
    if plan["disconnect"]:
        plan["max_tokens"] = LEAVER_TOKENS_FACTOR * spec.max_tokens
    return plan


def _route_and_body(model: str, plan: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The route and JSON body of a planned request, with its features."""
    features, chat = plan["features"], "chat" in plan["features"]
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": plan["max_tokens"],
        "n": plan["n"],
        "ignore_eos": True,
        "stream": plan["stream"],
    }
    if chat:
        body["messages"] = [{"role": "user", "content": plan["prompt"]}]
    else:
        body["prompt"] = plan["prompt"]
    if "sampling" in features:
        body.update(temperature=0.8, top_p=0.9, top_k=20, seed=plan["seed"], min_tokens=1,
                    presence_penalty=0.5, frequency_penalty=0.2)  # fmt: skip
    if "logprobs" in features:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if "stop" in features:
        body["stop"] = ["beta", "gamma"]
    if "json" in features:
        body["response_format"] = {"type": "json_object"}
    if "echo" in features and not chat and not plan["stream"]:
        body["echo"] = True
    if "tools" in features and chat and "json" not in features:
        body.update(tools=[_TOOL], tool_choice="required" if plan["seed"] % 2 else "auto")
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def _request(
    client: httpx.AsyncClient, model: str, plan: dict[str, Any], report: LoadReport
) -> None:
    route, body = _route_and_body(model, plan)
    try:
        if plan["stream"]:
            outcome = await _streamed(client, route, body, plan["disconnect"], report)
        elif plan["disconnect"]:
            # Gone before the answer: the server notices on its next disconnect poll.
            with_deadline = asyncio.wait_for(client.post(route, json=body), 0.05)
            try:
                response = await with_deadline
            except TimeoutError:
                outcome = DISCONNECTED
            else:
                outcome = _plain(response, report)
        else:
            outcome = _plain(await client.post(route, json=body), report)
    except httpx.HTTPError as exc:
        outcome = LOST
        report.errors.append(f"{type(exc).__name__}: {exc}")
    report.outcomes[outcome] += 1
    if outcome == DISCONNECTED:
        report.disconnected_choices += plan["n"]


def _plain(response: httpx.Response, report: LoadReport) -> str:
    report.statuses[response.status_code] += 1
    if response.status_code != 200:
        return _rejected(response, report)
    choices = response.json()["choices"]
    report.finished_choices += sum(c["finish_reason"] in ("stop", "length") for c in choices)
    return COMPLETED


def _rejected(response: httpx.Response, report: LoadReport) -> str:
    if response.status_code >= 500 and response.status_code != 503:
        report.errors.append(f"{response.status_code}: {response.text[:200]}")
        return SERVER_ERROR
    return REJECTED


async def _streamed(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], disconnect: bool,
    report: LoadReport,
) -> str:  # fmt: skip
    async with client.stream("POST", route, json=body) as response:
        report.statuses[response.status_code] += 1
        if response.status_code != 200:
            await response.aread()
            return _rejected(response, report)
        finished, done = 0, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if disconnect:
                return DISCONNECTED  # leaving the block closes the connection
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                report.errors.append(f"stream error: {chunk['error']}")
                return SERVER_ERROR
            finished += sum(c["finish_reason"] in ("stop", "length") for c in chunk["choices"])
        if not done:
            report.errors.append("stream ended without [DONE]")
            return LOST
        report.finished_choices += finished
        return COMPLETED


async def _finished(client: httpx.AsyncClient) -> dict[str, int]:
    return dict((await client.get("/load")).json().get("requests_finished", {}))


async def _wait_idle(client: httpx.AsyncClient, timeout_s: float = 30.0) -> bool:
    """True once the engine reports nothing running or waiting (and no request still queued)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # Stats are published every half second when idle; two idle readings in a row.
        load = (await client.get("/load")).json()
        if load.get("num_requests_running") == 0 and load.get("num_requests_waiting") == 0:
            await asyncio.sleep(0.6)
            load = (await client.get("/load")).json()
            if load.get("num_requests_running") == 0 and load.get("num_requests_waiting") == 0:
                return True
        await asyncio.sleep(0.2)
    return False
