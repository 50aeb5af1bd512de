"""The ingress's failure handling, with a stand-in for the replicas' deployment handle: a
replica that fails before its response begins is retried on another; one that fails mid-stream
ends the SSE stream with an error event; nothing is answered twice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

pytest.importorskip("ray", reason="replicas need Ray Serve: pip install 'tokenmill[ray]'")

from ray.exceptions import ActorDiedError

from tokenmill.deploy.ingress import Ingress
from tokenmill.deploy.routing import RoutedRequest

SSE = [("content-type", "text/event-stream")]


class Stream:
    """What `handle.options(stream=True).generate.remote(...)` returns: an async iterator."""

    def __init__(self, items: list[Any]) -> None:
        self.items = iter(items)
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        item = next(self.items, StopAsyncIteration)
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Replicas:
    """A deployment handle whose n-th call streams `scripts[n]`; records what it was sent."""

    def __init__(self, *scripts: list[Any]) -> None:
        self.scripts = list(scripts)
        self.sent: list[RoutedRequest] = []

    def options(self, stream: bool) -> Replicas:
        return self

    @property
    def generate(self) -> Replicas:
        return self

    def remote(self, routed: RoutedRequest) -> Stream:
        self.sent.append(routed)
        return Stream(self.scripts.pop(0))


def ingress(replicas: Replicas) -> Ingress:
    gateway = Ingress.__new__(Ingress)  # without its constructor's Ray actors
    gateway.replicas = replicas  # type: ignore[assignment]
    return gateway


async def body_of(response: Any) -> bytes:
    return b"".join([chunk async for chunk in response.body_iterator])


def test_a_replica_dying_before_its_response_begins_is_retried_elsewhere() -> None:
    replicas = Replicas(
        [{"replica": "r1"}, ActorDiedError()],
        [{"replica": "r2"}, {"status": 200, "headers": SSE}, b"data: one\n\n", b"data: [DONE]\n\n"],
    )
    routed = RoutedRequest("POST", "/v1/completions", b"{}")
    response = asyncio.run(ingress(replicas).forward(routed))
    assert response.status_code == 200
    assert asyncio.run(body_of(response)) == b"data: one\n\ndata: [DONE]\n\n"
    assert [r.avoid for r in replicas.sent] == [frozenset(), frozenset({"r1"})]


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    replicas = Replicas(
        [{"replica": "r1"}, {"status": 200, "headers": SSE}, b"data: one\n\n", ActorDiedError()]
    )
    response = asyncio.run(ingress(replicas).forward(RoutedRequest("POST", "/v1/completions")))
    events = asyncio.run(body_of(response)).decode().split("\n\n")
    assert events[0] == "data: one" and events[-2:] == ["data: [DONE]", ""]
    assert "failed mid-stream" in json.loads(events[1][6:])["error"]["message"]
    assert len(replicas.sent) == 1, "what was streamed is never sent again"


def test_when_every_attempt_fails_the_client_gets_a_503_naming_the_replicas() -> None:
    replicas = Replicas(*[[{"replica": f"r{i}"}, ActorDiedError()] for i in range(3)])
    response = asyncio.run(ingress(replicas).forward(RoutedRequest("GET", "/v1/models")))
    assert response.status_code == 503
    message = json.loads(response.body)["error"]["message"]
    assert all(f"r{i}: ActorDiedError" in message for i in range(3)), message


JSON = [("content-type", "application/json")]
UNKNOWN_ID = b'{"error":{"message":"request_id: no finished request","param":"request_id"}}'


def test_feedback_and_traces_reach_the_replica_that_served_the_request() -> None:
    # Only the replica that served a response knows its id: the others are asked in turn.
    replicas = Replicas(
        [{"replica": "r1"}, {"status": 400, "headers": JSON}, UNKNOWN_ID],
        [{"replica": "r2"}, {"status": 200, "headers": JSON}, b'{"object":"feedback"}'],
    )
    response = asyncio.run(ingress(replicas).forward(RoutedRequest("POST", "/v1/feedback")))
    assert response.status_code == 200
    assert [r.avoid for r in replicas.sent] == [frozenset(), frozenset({"r1"})]
    # Asked every replica (the router hands back one asked already): its answer stands.
    not_found = [{"status": 404, "headers": JSON}, b'{"error":{"message":"no trace"}}']
    replicas = Replicas(
        [{"replica": "r1"}, *not_found], [{"replica": "r2"}, *not_found],
        [{"replica": "r1"}, *not_found],
    )  # fmt: skip
    response = asyncio.run(ingress(replicas).forward(RoutedRequest("GET", "/v1/traces/cmpl-x")))
    assert response.status_code == 404 and len(replicas.sent) == 3
    # Any other 400 or 404 is the client's, the same on every replica: not asked again.
    replicas = Replicas([{"replica": "r1"}, *not_found])
    response = asyncio.run(ingress(replicas).forward(RoutedRequest("GET", "/v1/nothing")))
    assert response.status_code == 404 and len(replicas.sent) == 1


class Answer:
    """What `httpx.AsyncClient.get` returns, as far as the ingress reads it."""

    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        self.status_code, self.payload = status, payload
        self.content = json.dumps(payload).encode()
        self.headers = {"content-type": "application/json"}

    def json(self) -> dict[str, Any]:
        return self.payload


def gathering(answers: dict[str, Answer | None]) -> tuple[Ingress, list[str]]:
    """An ingress whose directory lists `answers`' replicas, each answering GETs with its own
    (None: unreachable); also the URLs it asked."""
    asked: list[str] = []

    class Listing:
        async def remote(self) -> dict[str, str]:
            return {name: f"http://{name}" for name in answers}

    class Http:
        async def get(self, url: str, headers: dict[str, str]) -> Answer:
            asked.append(url)
            answer = answers[url.split("/")[2]]
            if answer is None:
                raise httpx.ConnectError("down")
            return answer

    gateway = ingress(Replicas())
    gateway.directory = type("Directory", (), {"list": Listing()})()  # type: ignore[assignment]
    gateway.http = Http()  # type: ignore[assignment]
    return gateway, asked


def test_feedback_listed_through_the_ingress_merges_every_replicas_newest_first() -> None:
    def items(*created: float) -> Answer:
        return Answer(200, {"object": "list", "data": [{"created": c} for c in created]})

    gateway, asked = gathering({"r1": items(5, 1), "r2": items(4, 3, 2), "r3": None})
    response = asyncio.run(gateway.feedback("limit=4"))
    assert [f["created"] for f in json.loads(response.body)["data"]] == [5, 4, 3, 2]
    assert sorted(asked) == [f"http://r{i}/v1/feedback?limit=4" for i in (1, 2, 3)]
    refusal = Answer(400, {"error": {"message": "limit: ...", "param": "limit"}})
    gateway, _ = gathering({"r1": items(5), "r2": refusal})
    response = asyncio.run(gateway.feedback("limit=0"))
    assert response.status_code == 400 and json.loads(response.body)["error"]["param"] == "limit"
    gateway, _ = gathering({"r1": None})
    assert asyncio.run(gateway.feedback("")).status_code == 503


class Body:
    """A starlette request of `body`, with or without its Content-Length."""

    def __init__(self, body: bytes, length: bool = True) -> None:
        self.method, self.data = "POST", body
        self.url = type("Url", (), {"path": "/v1/completions", "query": ""})()
        self.headers = {"content-length": str(len(body))} if length else {}

    async def stream(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), 4):
            yield self.data[i : i + 4]


def test_a_body_over_the_servers_limit_is_a_413_at_the_ingress() -> None:
    # The replicas' servers would answer 413 mid-upload: the ingress saw a broken connection,
    # sent the body to every replica in turn, then answered 503.
    replicas = Replicas()
    gateway = ingress(replicas)
    gateway.max_request_body_bytes = 10
    for request in (Body(b"x" * 11), Body(b"x" * 11, length=False)):
        response = asyncio.run(gateway(request))  # type: ignore[arg-type]
        assert response.status_code == 413, response.body
        assert json.loads(response.body)["error"]["type"] == "RequestTooLargeError"
    assert replicas.sent == []
