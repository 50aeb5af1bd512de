"""Messages between the server's processes; msgpack-encoded msgspec structs, no pickled objects.

api server ──TokenizeRequest──▶ tokenizer worker ──EngineRequest──▶ engine core
engine core ──EngineStep──▶ detokenizer ──ClientOutput──▶ api server
api server / detokenizer ──AbortRequest──▶ engine core
tokenizer worker / engine core ──(ClientOutput with an error)──▶ api server (via detokenizer)
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.observability.histogram import Histogram
from tokenmill.observability.request_metrics import RequestMetrics
from tokenmill.sampling_params import SamplingParams


class TokenizeRequest(msgspec.Struct, tag=True):
    """A client request to turn into token ids: a completion prompt or a chat."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class EngineRequest(msgspec.Struct, tag=True):
    """A tokenized request for the engine; `request_id` is `"{client id}:{choice index}"`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag=True):
    """Finish these requests now; `reason` is a FinishReason value ("abort" or "stop")."""

    request_ids: list[str]
    reason: str = "abort"


class ShutdownRequest(msgspec.Struct, tag=True):
    """Finish every request with "abort" and stop."""


class ResetPrefixCacheRequest(msgspec.Struct, tag=True):
    """Drop every cached prefix no running request uses."""


class ProfileRequest(msgspec.Struct, tag=True):
    """Start (or stop and write) a torch profiler trace of the engine core into `directory`."""

    start: bool
    directory: str


# (token id, logprob, rank); the sampled token comes first, then the top alternatives.
TokenLogprobs = list[tuple[int, float, int]]


class RequestDelta(msgspec.Struct):
    """New tokens of one engine request in one step."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None = None


class EngineStats(msgspec.Struct):
    """A snapshot of the engine core's load, sent with every step and when idle."""

    num_running: int
    num_waiting: int
    kv_used_pages: int
    kv_total_pages: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    finished: dict[str, int]  # requests finished so far, by finish reason
    prompt_tokens: int
    generation_tokens: int
    histograms: dict[str, Histogram]  # scheduler_step_seconds, model_forward_seconds, ...


class NewRequest(msgspec.Struct):
    """Sent by the engine to the detokenizer when it accepts a request (before its tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestError(msgspec.Struct):
    """A request the engine or a tokenizer refused; `status` is the HTTP status to return."""

    request_id: str
    message: str
    status: int = 400
    param: str | None = None


class EngineStep(msgspec.Struct, tag=True):
    """Everything the engine core produced in one iteration."""

    new_requests: list[NewRequest]
    deltas: list[RequestDelta]
    errors: list[RequestError]
    stats: EngineStats


class ClientOutput(msgspec.Struct):
    """Decoded output of one engine request, for the api server."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, str, float, int]]] | None  # (id, text, logprob, rank)
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None = None


class ClientBatch(msgspec.Struct, tag=True):
    """Outputs and errors for the api server, with the engine's latest stats."""

    outputs: list[ClientOutput]
    errors: list[RequestError]
    stats: EngineStats | None = None


EngineInput = (
    EngineRequest | AbortRequest | ShutdownRequest | ProfileRequest | ResetPrefixCacheRequest
)
