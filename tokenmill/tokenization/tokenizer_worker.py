"""Tokenizer worker process: renders chats, tokenizes, and hands each request to the intake."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.intake import ContextLimits, IntakeError, owner_request_id, prepare
from tokenmill.ipc.messages import (
    AbortRequest,
    ClientBatch,
    DroppedRequests,
    EngineRequest,
    ImagePayload,
    RequestError,
    TokenizeRequest,
)
from tokenmill.ipc.process import init_child
from tokenmill.ipc.sockets import Addresses, encode, pull, push, request_id_of
from tokenmill.tokenization.tokenizer import (
    encode_prompt,
    load_tokenizer,
    render_chat,
    with_bad_words,
)
from tokenmill.vision.images import ImagePreprocessor, ImageSetup, RequestCancelled

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def run_tokenizer_worker(
    index: int,
    tokenizer_path: str,
    limits: ContextLimits,
    addresses: Addresses,
    log_level: str,
    server_pid: int,
    chat_template: str | None = None,
    images: ImageSetup | None = None,
) -> None:
    """Process entry point: tokenize requests from the api server until killed (`images`:
    the model's image preprocessing, for a vision-language model)."""
    init_child(log_level, f"tokenizer_{index}", server_pid)
    preprocessor = ImagePreprocessor(images) if images is not None else None
    worker = TokenizerWorker(load_tokenizer(tokenizer_path, chat_template), limits, preprocessor)
    ctx = zmq.Context()
    inbox = Inbox(pull(ctx, addresses.tokenizers[index], bind=True))
    to_engine = push(ctx, addresses.engine, bind=False)
    to_api = push(ctx, addresses.api, bind=False)
    while True:
        engine_requests, error = worker.handle(inbox.next(), inbox.ended)
        for request in engine_requests:
            to_engine.send(request)
        if error is not None:
            to_api.send(encode(ClientBatch(outputs=[], errors=[error])))
        if dropped := inbox.take_dropped():
            to_engine.send(encode(DroppedRequests(dropped)))


class _Addressed(msgspec.Struct, tag="TokenizeRequest"):
    """A `TokenizeRequest` read for its id alone (the rest is skipped, not decoded)."""

    request_id: str


class Inbox:
    """A tokenizer worker's messages from the api server, read ahead of the request in hand.

    The api server sends an `AbortRequest` naming the choices (engine request ids) of the
    sub-requests of a request it has ended (another of its prompts refused, its client gone);
    those still queued here are dropped, not tokenized. One request of 34 prompts of 462 kB,
    each refused after ~0.3 s of tokenizing, was answered after the first, yet held the next
    request 11 s. What is dropped (and the request in hand, when its images stop being read)
    is reported to the engine (`take_dropped`), which counts it as aborted.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._queued: deque[tuple[str | None, bytes]] = deque()  # (request id, message)
        self._decoder = msgspec.msgpack.Decoder(_Addressed | AbortRequest)
        # Ended since the request in hand was handed out: sub-request id -> its choices' ids.
        self._ended: dict[str, list[str]] = {}
        self._dropped: list[str] = []  # choices of requests dropped unsent, not yet reported

    def next(self) -> bytes:
        """The next encoded `TokenizeRequest` to handle, after everything that has arrived
        (blocks while there is none)."""
        self._ended.clear()
        while True:
            if not self._queued:
                self._take(self._sock.recv())
            self._take_arrived()
            if self._queued:
                return self._queued.popleft()[1]

    def ended(self, request_id: str) -> bool:
        """Whether the api server has ended `request_id`, the request in hand, meanwhile (read
        without blocking; what else arrived is queued): its images need not be read on (a
        request of eight 16-megapixel images, its client gone, held the worker until all were
        preprocessed)."""
        self._take_arrived()
        if request_id not in self._ended:
            return False
        # The worker stops reading it: nothing of it is sent (reported once).
        self._dropped += self._ended[request_id]
        self._ended[request_id] = []
        return True

    def take_dropped(self) -> list[str]:
        """The choices (engine request ids) of the requests dropped unsent since the last
        call."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _take_arrived(self) -> None:
        while True:
            try:
                self._take(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return

    def _take(self, raw: bytes) -> None:
        try:
            message = self._decoder.decode(raw)
        except msgspec.DecodeError:  # `TokenizerWorker.handle` answers it
            self._queued.append((None, raw))
            return
        if isinstance(message, _Addressed):
            self._queued.append((message.request_id, raw))
            return
        ended: dict[str, list[str]] = {}
        for child_id in message.request_ids:
            ended.setdefault(owner_request_id(child_id), []).append(child_id)
        kept: deque[tuple[str | None, bytes]] = deque()
        for item in self._queued:
            if item[0] in ended:
                self._dropped += ended.pop(item[0])
            else:
                kept.append(item)
        self._queued = kept
        self._ended.update(ended)


class TokenizerWorker:
    """Turns one encoded `TokenizeRequest` into encoded engine requests, or an error for it.

    Nothing a request holds can end the process: bad input is a 400 naming the field, anything
    unexpected a 500 for that request alone (and a logged traceback).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        limits: ContextLimits,
        images: ImagePreprocessor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.images = images
        self._decoder = msgspec.msgpack.Decoder(TokenizeRequest)

    def handle(
        self, raw: bytes, ended: Callable[[str], bool] = lambda _: False
    ) -> tuple[list[bytes], RequestError | None]:
        """(encoded `EngineRequest`s, None), or ([], the error to send to the api server);
        ([], None) for a request `ended` says the api server ended while its images were read."""
        try:
            req = self._decoder.decode(raw)
        except msgspec.DecodeError as exc:  # a value the struct refuses (or a bug upstream)
            request_id = request_id_of(raw)
            if request_id is None:
                logger.error("dropped an undecodable tokenize request: %s", exc)
                return [], None
            return [], RequestError(request_id, str(exc), status=400)
        field = "messages" if req.messages is not None else "prompt"
        try:
            return self._engine_requests(req, lambda: ended(req.request_id)), None
        except RequestCancelled:
            logger.debug("request %s ended while its images were read", req.request_id)
            return [], None
        except IntakeError as exc:
            param = field if exc.param == "prompt" else exc.param
            return [], RequestError(req.request_id, str(exc), status=400, param=param)
        except ValueError as exc:  # the prompt or chat itself
            return [], RequestError(req.request_id, str(exc), status=400, param=field)
        except Exception as exc:  # a bug must fail its request, not the worker
            logger.exception("tokenizing request %s failed", req.request_id)
            message = f"tokenizing the request failed: {exc!r}"
            return [], RequestError(req.request_id, message, status=500)

    def _engine_requests(self, req: TokenizeRequest, cancelled: Callable[[], bool]) -> list[bytes]:
        images: list[ImagePayload] = []
        if req.messages is not None:
            ids, inputs = render_chat(
                self.tokenizer, req.messages, self.images, req.tools, req.chat_options, cancelled
            )
            images = [ImagePayload.of(image) for image in inputs]
        elif req.prompt is not None:
            ids = encode_prompt(self.tokenizer, req.prompt, req.add_special_tokens)
            if self.images is not None and self.images.vision.image_token_id in ids:
                raise ValueError(
                    "prompt: holds an image placeholder token, but images come only in chat "
                    "messages (image_url parts)"
                )
        else:
            raise ValueError("prompt or messages must be given, got neither")
        params = with_bad_words(self.tokenizer, req.params)
        children = prepare(req.request_id, ids, params, self.limits, bool(images))
        return [
            encode(EngineRequest(c.request_id, c.prompt_token_ids, c.params, images))
            for c in children
        ]
