"""User feedback tied to the request that produced it.

The server remembers the ids of its most recent finished requests (bounded: `RecentRequests`),
with where their lines are in the trace file, so that `POST /v1/feedback` can refuse an unknown
id and `GET /v1/traces/{id}` can read a request's trace back. A feedback is counted
(`tokenmill:feedback_total{rating}`), kept in a short list for the dashboard, and written to the
trace file next to the request's own lines:

    {"event": "feedback", "feedback_id": ..., "request_id": <the response id>, "rating": -1,
     "comment": ..., "created": <unix time>}

The `request_id` a client rates is the `id` of the response it got (`cmpl-...`, `chatcmpl-...`);
each trace line of that request carries it as `response_id`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

RATINGS = (-1, 0, 1)  # bad, neutral, good
NEGATIVE = -1


def response_id_of(choice_id: str) -> str:
    """The response id of an engine request id, `"{response id}-{prompt}:{choice}"` (the api
    server names sub-requests `{response id}-{prompt}`, intake adds `:{choice}`)."""
    sub_request = choice_id.rpartition(":")[0] or choice_id
    return sub_request.rpartition("-")[0] or sub_request


@dataclass(frozen=True)
class Feedback:
    """One rating of one response."""

    feedback_id: str
    request_id: str
    rating: int
    comment: str | None
    created: float
    has_trace: bool  # the request's trace lines are in the trace file

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RecentRequests:
    """The last `capacity` finished responses: id → byte offsets of their trace lines."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._offsets: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def add(self, response_id: str, trace_offset: int | None) -> None:
        """Remember a finished choice of `response_id` (one trace line at `trace_offset`)."""
        offsets = self._offsets.pop(response_id, ())
        if trace_offset is not None:
            offsets = (*offsets, trace_offset)
        self._offsets[response_id] = offsets
        while len(self._offsets) > self.capacity:
            self._offsets.popitem(last=False)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._offsets

    def __len__(self) -> int:
        return len(self._offsets)

    def trace_offsets(self, response_id: str) -> tuple[int, ...]:
        return self._offsets.get(response_id, ())


class FeedbackLog:
    """Accepts feedback for recent requests: counts it, keeps the latest, writes it to the trace.

    All methods run on the api server's event loop (no locking).
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry,
        max_recent_requests: int,
        trace_path: str | None,
        write_trace: Callable[[dict[str, Any]], int | None],
        max_listed: int = 1000,
    ) -> None:
        self.requests = RecentRequests(max_recent_requests)
        self.trace_path = Path(trace_path) if trace_path else None
        self._write_trace = write_trace
        self.latest: deque[Feedback] = deque(maxlen=max_listed)
        counter = Counter(
            "tokenmill:feedback", "User feedback by rating (-1 bad, 0 neutral, 1 good), "
            "POST /v1/feedback.", ["model_name", "rating"], registry=registry,
        )  # fmt: skip
        self.counts = {r: counter.labels(model_name, str(r)) for r in RATINGS}

    def unknown_request_message(self, request_id: str) -> str | None:
        """Why feedback for `request_id` cannot be taken (None: it can)."""
        if request_id in self.requests:
            return None
        return (
            f"request_id: no finished request {request_id!r} among the last "
            f"{self.requests.capacity} this server remembers (--max-recent-requests); give the "
            "`id` of a completion or chat completion response"
        )

    def add(self, request_id: str, rating: int, comment: str | None) -> Feedback:
        """Record feedback for a known request (see `unknown_request_message`)."""
        feedback = Feedback(
            feedback_id="feedback-" + uuid.uuid4().hex,
            request_id=request_id,
            rating=rating,
            comment=comment,
            created=time.time(),
            has_trace=bool(self.requests.trace_offsets(request_id)),
        )
        self.counts[rating].inc()
        self.latest.append(feedback)
        record = {"event": "feedback", **feedback.to_json()}
        del record["has_trace"]
        self._write_trace(record)
        return feedback

    def recent(self, max_rating: int | None, limit: int) -> list[Feedback]:
        """The latest feedback, newest first, optionally only ratings <= `max_rating`."""
        chosen = [f for f in reversed(self.latest) if max_rating is None or f.rating <= max_rating]
        return chosen[:limit]

    def for_request(self, request_id: str) -> list[Feedback]:
        return [f for f in self.latest if f.request_id == request_id]

    def read_trace(self, request_id: str) -> list[dict[str, Any]]:
        """The trace lines of a recent request, read back from the trace file ([] if none).

        A line that no longer holds this request (the file was rotated or truncated) is skipped;
        so is a file no longer there (renamed away by a log rotation).
        """
        offsets = self.requests.trace_offsets(request_id)
        if self.trace_path is None or not offsets:
            return []
        lines = []
        try:
            f = self.trace_path.open("rb")
        except FileNotFoundError:
            return []
        with f:
            for offset in offsets:
                f.seek(offset)
                try:
                    record = json.loads(f.readline())
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("response_id") == request_id:
                    lines.append(record)
        return lines
