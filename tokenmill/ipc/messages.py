"""Messages between the server's processes; msgpack-encoded msgspec structs, no pickled objects.

api server ──TokenizeRequest──▶ tokenizer worker ──EngineRequest──▶ engine core
engine core ──EngineStep──▶ detokenizer ──ClientOutput──▶ api server
api server / detokenizer ──AbortRequest──▶ engine core
tokenizer worker / engine core ──(ClientOutput with an error)──▶ api server (via detokenizer)
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from tokenmill.observability.histogram import Histogram
from tokenmill.observability.request_metrics import RequestMetrics
from tokenmill.sampling_params import SamplingParams, is_valid_text
from tokenmill.tokenization.chat_options import DEFAULT_CHAT_OPTIONS, ChatTemplateOptions
from tokenmill.vision.inputs import ImageInput

# The integers msgpack carries.
MIN_WIRE_INT, MAX_WIRE_INT = -(2**63), 2**64 - 1


class TokenizeRequest(msgspec.Struct, tag=True):
    """A client request to turn into token ids: a completion prompt or a chat.

    Construction (and decoding) raises `ValueError` naming the field for a value msgpack can not
    carry (an integer beyond 64 bits, a string with an unpaired surrogate), so that no such
    value reaches an encoder.
    """

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    tools: list[dict[str, Any]] | None = None  # offered to the chat template
    chat_options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS

    def __post_init__(self) -> None:
        check_wire_value(self.prompt, "prompt")
        check_wire_value(self.messages, "messages")
        check_wire_value(self.chat_options.template_kwargs, "chat_template_kwargs")


class ImagePayload(msgspec.Struct):
    """One preprocessed image on the wire: its float32 pixel patches as raw bytes (msgpack
    `bin`: one copy in, a zero-copy numpy view out; never a list of floats)."""

    key: int
    pixels: bytes
    grid_thw: tuple[int, int, int]
    offset: int
    num_tokens: int

    @staticmethod
    def of(image: ImageInput) -> ImagePayload:
        pixels = np.ascontiguousarray(image.pixel_values, dtype=np.float32)
        return ImagePayload(image.key, pixels.tobytes(), image.grid_thw, image.offset,
                            image.num_tokens)  # fmt: skip

    def image(self) -> ImageInput:
        """The image, its pixels a view of this message's bytes."""
        t, h, w = self.grid_thw
        pixels = np.frombuffer(self.pixels, dtype=np.float32)
        if t * h * w <= 0 or pixels.size % (t * h * w):
            raise ValueError(f"images: {pixels.size} pixel values for grid {self.grid_thw}")
        pixels = pixels.reshape(t * h * w, -1)
        return ImageInput(self.key, pixels, self.grid_thw, self.offset, self.num_tokens)


class EngineRequest(msgspec.Struct, tag=True):
    """A tokenized request for the engine: one choice (`intake.child_request_id`); `images`
    fill its image placeholder tokens (vision-language models)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: list[ImagePayload] = msgspec.field(default_factory=list)


class AbortRequest(msgspec.Struct, tag=True):
    """Finish these requests now; `reason` is a FinishReason value ("abort" or "stop")."""

    request_ids: list[str]
    reason: str = "abort"


class DroppedRequests(msgspec.Struct, tag=True):
    """Engine requests a tokenizer worker dropped unsent: the api server ended their client
    request before they were tokenized. The engine core counts them as aborted (it never saw
    them, and forgets the aborts it may hold for them)."""

    request_ids: list[str]


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
    # With a request's first tokens, if its params ask (`SamplingParams.prompt_logprobs`):
    # one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


# A step's kind: only prefill rows (prompt chunks), prefill rows beside decode rows, or only
# decode rows (decodes and speculative verifies). EngineStats' histograms of step times are
# also kept by kind (`<name>_<kind>_steps`).
STEP_KINDS = ("prefill", "mixed", "decode")


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
    engine_pid: int = 0  # tells a restarted engine core's steps from its predecessor's
    # Speculative decoding (None when off): drafts, drafted and accepted tokens, per position.
    spec_decode: SpecDecodeCounts | None = None
    # The host KV tier (None when off).
    host_kv_cache: HostKVCacheCounts | None = None
    # The vision encoder (None for a text-only model).
    vision_encoder: VisionEncoderCounts | None = None
    # Seconds of each phase of the engine core's start-up, in order (they add up to it).
    startup_seconds: dict[str, float] = msgspec.field(default_factory=dict)
    # When its start-up ended (`time.time()`; 0: not said): the api server tells how long the
    # first stats took to reach it.
    startup_ended_at: float = 0.0
    # CUDA graphs and builds ahead (cuDNN's) still to capture in the background: a step that
    # needs one first waits for its capture (0: all done, or captured at start-up).
    graphs_pending: int = 0


class HostKVCacheCounts(msgspec.Struct):
    """Cumulative host KV tier counts: prefix tokens loaded back instead of recomputed, bytes
    each way, seconds the loads took, and the tier's pages in use."""

    hit_tokens: int
    bytes_loaded: int
    bytes_written: int
    load_seconds: float
    used_pages: int
    total_pages: int


class VisionEncoderCounts(msgspec.Struct):
    """Cumulative vision-encoder counts: images encoded, images whose outputs were reused
    (the encoder cache), and seconds the encoder ran (device time on CUDA)."""

    images_encoded: int
    cache_hits: int
    seconds: float


class SpecDecodeCounts(msgspec.Struct):
    """Cumulative speculative-decoding counts (vLLM's spec_decode metrics)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]


class NewRequest(msgspec.Struct):
    """Sent by the engine to the detokenizer when it accepts a request (before its tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def param_of(message: str) -> str | None:
    """The request field a validation message names (SamplingParams messages start with it, or
    with a path into it: `response_format.json_schema.schema ...` names `response_format`)."""
    word = message.split(" ", 1)[0].rstrip(":").split(".", 1)[0]
    return word if word.isidentifier() else None


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


# A token's logprob entry with texts: (id, text, logprob, rank), the token itself first, then
# its alternatives.
TextLogprobs = list[tuple[int, str, float, int]]


class PromptTextLogprobs(msgspec.Struct):
    """A prompt's tokens with their logprobs: the first token (nothing predicts it) and, for
    each token after it, its entry."""

    first_token: tuple[int, str]
    entries: list[TextLogprobs]


class ClientOutput(msgspec.Struct):
    """Decoded output of one engine request, for the api server.

    `prompt_logprobs`: with a request's first output, if its params ask for them.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TextLogprobs] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptTextLogprobs | None = None


class ClientBatch(msgspec.Struct, tag=True):
    """Outputs and errors for the api server, with the engine's latest stats.

    `started`: the engine requests the engine core accepted in this step (a request not yet
    started is still with a tokenizer worker, and is lost if that worker dies).
    """

    outputs: list[ClientOutput]
    errors: list[RequestError]
    stats: EngineStats | None = None
    started: list[str] = msgspec.field(default_factory=list)


EngineInput = (
    EngineRequest
    | AbortRequest
    | DroppedRequests
    | ShutdownRequest
    | ProfileRequest
    | ResetPrefixCacheRequest
)


def check_wire_value(value: object, name: str) -> None:
    """Raise `ValueError` naming `name` if msgpack can not carry `value` (JSON-like data)."""
    if isinstance(value, str):
        if not is_valid_text(value):
            raise ValueError(f"{name} must be valid Unicode text, got an unpaired surrogate")
    elif isinstance(value, bool) or value is None or isinstance(value, float):
        return
    elif isinstance(value, int):
        if not MIN_WIRE_INT <= value <= MAX_WIRE_INT:
            raise ValueError(f"{name} holds an integer beyond 64 bits, got {value}")
    elif isinstance(value, list | tuple):
        if value and all(type(item) is int for item in value):  # token ids: checked in C
            if not (min(value) >= MIN_WIRE_INT and max(value) <= MAX_WIRE_INT):
                raise ValueError(f"{name} holds an integer beyond 64 bits")
            return
        for item in value:
            check_wire_value(item, name)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_wire_value(key, name)
            check_wire_value(item, name)
