"""The ingress: the one OpenAI-compatible endpoint in front of the replicas.

It reads each request's body once, computes what the router needs (`prefix_blocks`, the
session: header `x-session-id`, else the body's `user`), and streams the chosen replica's
response back. A replica that dies before its response has begun (no body byte sent) is
retried on another; one that dies mid-stream ends an SSE stream with an error event and
`[DONE]`, so a client never waits forever nor gets an answer twice. `/metrics` gathers every
replica's metrics, each sample labelled `replica`, plus the replica count; `GET /v1/feedback`
every replica's feedback (each holds that on the responses it served), newest first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException, RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenmill.deploy.directory import directory
from tokenmill.deploy.routing import RoutedRequest, prefix_blocks

logger = logging.getLogger("tokenmill.deploy")

DASHBOARD_HTML = Path(__file__).resolve().parent.parent / "dashboard" / "index.html"
SESSION_HEADER = "x-session-id"
MAX_ATTEMPTS = 3
METRICS_TIMEOUT_S = 5.0
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?( .*)$")


class ReplicaFailed(Exception):
    """A replica failed a request before its response began."""


def error_response(
    status: int, message: str, kind: str = "ServiceUnavailableError"
) -> JSONResponse:
    error = {"message": message, "type": kind, "param": None, "code": status}
    return JSONResponse({"error": error}, status_code=status)


def _too_large() -> JSONResponse:
    """The replicas' servers' 413 (`api_server._BodyLimit`), answered before the body is sent
    on: a server answering it mid-upload breaks the connection, which reads as a failed
    replica."""
    message = "request body is larger than this server's limit (--max-request-body-bytes)"
    response = error_response(413, message, "RequestTooLargeError")
    response.headers["connection"] = "close"
    return response


class Ingress:
    """Ray Serve deployment: HTTP in, `TokenmillReplica.generate` calls out."""

    def __init__(
        self, replicas: DeploymentHandle, app_name: str, max_request_body_bytes: int = 16 << 20
    ) -> None:
        self.replicas = replicas
        self.max_request_body_bytes = max_request_body_bytes
        self.directory = directory(app_name)
        self.http = httpx.AsyncClient(timeout=METRICS_TIMEOUT_S)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == "/metrics":
            text = await self.metrics(request.headers.get("authorization"))
            return Response(text, media_type="text/plain; version=0.0.4")
        if request.method == "GET" and path == "/dashboard":
            return Response(DASHBOARD_HTML.read_text(), media_type="text/html")
        if request.method == "GET" and path == "/health":
            servers = await self.directory.list.remote()
            return Response(status_code=200 if servers else 503)
        if request.method == "GET" and path == "/v1/feedback":
            return await self.feedback(request.url.query, request.headers.get("authorization"))
        body = await self._body(request)
        if body is None:
            return _too_large()
        routed = RoutedRequest(
            method=request.method,
            path=path,
            body=body,
            headers=tuple((k.lower(), v) for k, v in request.headers.items()),
            query=request.url.query,
            **_routing_keys(body, request.headers.get(SESSION_HEADER)),
        )
        return await self.forward(routed)

    async def _body(self, request: Request) -> bytes | None:
        """The request's body; None past --max-request-body-bytes."""
        limit = self.max_request_body_bytes
        length = request.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > limit:
            return None
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return None
        return bytes(body)

    async def forward(self, routed: RoutedRequest) -> Response:
        """The response of the first replica that begins one (up to `MAX_ATTEMPTS` replicas).

        Feedback on a response, and its trace, are known only to the replica that served it:
        a replica answering that it does not know the id is skipped for the next one, until
        the router hands back a replica asked already (every one was), whose answer stands.
        """
        failures = []
        attempts = 0
        while attempts < MAX_ATTEMPTS:
            stream = self.replicas.options(stream=True).generate.remote(routed)
            try:
                replica, head, first = await self._begin(stream)
            except ReplicaFailed as exc:
                attempts += 1
                replica, cause = exc.args
                failures.append(f"{replica or 'a replica'}: {type(cause).__name__}")
                if replica is not None:
                    routed = replace(routed, avoid=routed.avoid | {replica})
                continue
            if _unknown_id(routed, head["status"], first) and replica not in routed.avoid:
                stream.cancel()
                routed = replace(routed, avoid=routed.avoid | {replica})
                continue
            media = dict(head["headers"]).get("content-type", "")
            body = _rest(stream, first, sse=media.startswith("text/event-stream"))
            return StreamingResponse(
                body, status_code=head["status"], headers=dict(head["headers"])
            )
        return error_response(503, f"no replica could serve the request ({'; '.join(failures)})")

    async def _begin(
        self, stream: DeploymentResponseGenerator
    ) -> tuple[str, dict[str, Any], bytes]:
        """The replica, its response head and first body chunk; `ReplicaFailed` if it fails
        first."""
        replica = None
        try:
            replica = (await stream.__anext__())["replica"]
            head = await stream.__anext__()
            first = await anext(stream, b"")
        except RequestCancelledError:
            raise
        except (RayError, RayServeException) as exc:
            logger.warning("replica %s failed a request before answering: %r", replica, exc)
            raise ReplicaFailed(replica, exc) from exc
        return replica, head, first

    async def feedback(self, query: str, authorization: str | None = None) -> Response:
        """`GET /v1/feedback` of every replica, merged newest first and cut to the query's
        `limit`; a replica's refusal (a bad query, missing credentials) is the answer."""
        answers = await self._ask_every_replica(f"/v1/feedback?{query}", authorization)
        answered = [a for a in answers.values() if a is not None]
        if not answered:
            return error_response(503, "no replica answered GET /v1/feedback")
        for answer in answered:
            if answer.status_code != 200:
                media = answer.headers.get("content-type")
                return Response(answer.content, answer.status_code, media_type=media)
        items = [item for answer in answered for item in answer.json()["data"]]
        items.sort(key=lambda item: item["created"], reverse=True)
        limit = int(parse_qs(query).get("limit", ["50"])[-1])  # the replicas checked it
        return JSONResponse({"object": "list", "data": items[:limit]})

    async def metrics(self, authorization: str | None = None) -> str:
        """Every replica's /metrics, samples labelled `replica`, and `tokenmill:replicas`
        (with the caller's credentials: the replicas check them if --metrics-require-auth)."""
        answers = await self._ask_every_replica("/metrics", authorization)
        texts = {
            replica: answer.text if answer is not None and answer.status_code == 200 else ""
            for replica, answer in answers.items()
        }
        return merge_metrics(texts)

    async def _ask_every_replica(
        self, path: str, authorization: str | None
    ) -> dict[str, httpx.Response | None]:
        """`GET path` of every replica's server at once, with the caller's credentials, by
        replica (None: it did not answer)."""
        servers: dict[str, str] = await self.directory.list.remote()
        headers = {"authorization": authorization} if authorization else {}

        async def ask(url: str) -> httpx.Response | None:
            try:
                return await self.http.get(url + path, headers=headers)
            except httpx.HTTPError:
                return None

        answers = await asyncio.gather(*(ask(url) for url in servers.values()))
        return dict(zip(servers, answers, strict=True))


async def _rest(
    stream: DeploymentResponseGenerator, first: bytes, sse: bool
) -> AsyncIterator[bytes]:
    yield first
    try:
        async for chunk in stream:
            yield chunk
    except (GeneratorExit, asyncio.CancelledError):
        stream.cancel()  # the client left: the replica's server aborts the request
        raise
    except (RayError, RayServeException) as exc:
        if not sse:
            raise
        logger.warning("a replica failed mid-stream: %r", exc)
        message = "the replica serving this request failed mid-stream; the response is cut short"
        error = {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}
        yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


def _unknown_id(routed: RoutedRequest, status: int, first: bytes) -> bool:
    """The replica does not know the response id this request names (another served it)."""
    if routed.method == "POST" and routed.path == "/v1/feedback":
        return status == 400 and b'"param":"request_id"' in first
    return routed.method == "GET" and routed.path.startswith("/v1/traces/") and status == 404


def _routing_keys(body: bytes, session: str | None) -> dict[str, Any]:
    try:
        parsed = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        parsed = None  # the replica answers it with a 400
    if not isinstance(parsed, dict):
        return {"prefix": (), "session": session}
    user = parsed.get("user")
    if session is None and isinstance(user, str) and user:
        session = user
    return {"prefix": prefix_blocks(parsed), "session": session}


def replica_label(replica_id: str) -> str:
    """The short, unique part of a Ray Serve replica id (`app#deployment#xyz` -> `xyz`)."""
    return replica_id.rsplit("#", 1)[-1]


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus text of several replicas as one: each family once (its HELP and TYPE, then
    every replica's samples with a `replica` label), and `tokenmill:replicas`."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica_id, text in texts.items():
        label = f'replica="{replica_label(replica_id)}"'
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                lines = headers.setdefault(family, [])
                if len(lines) < 2 and line not in lines:
                    lines.append(line)
                samples.setdefault(family, [])
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, value = match.groups()
            labels = f"{{{label},{labels[1:]}" if labels and labels != "{}" else f"{{{label}}}"
            samples.setdefault(family or name, []).append(f"{name}{labels}{value}")
    out = [
        "# HELP tokenmill:replicas Replicas serving (reporting metrics).",
        "# TYPE tokenmill:replicas gauge",
        f"tokenmill:replicas {len(texts)}",
    ]
    for family, lines in samples.items():
        out += headers.get(family, []) + lines
    return "\n".join(out) + "\n"
