"""Detokenizer process: turns engine steps into text deltas, applies stop strings."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from tokenmill.ipc.messages import (
    AbortRequest,
    ClientBatch,
    ClientOutput,
    EngineStep,
    PromptTextLogprobs,
    RequestDelta,
    RequestError,
    TextLogprobs,
    TokenLogprobs,
)
from tokenmill.ipc.process import init_child
from tokenmill.ipc.sockets import Addresses, encode, pull, push
from tokenmill.tokenization.detokenizer import ChoiceStream, ChoiceUpdate
from tokenmill.tokenization.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def run_detokenizer(
    tokenizer_path: str, addresses: Addresses, log_level: str, server_pid: int
) -> None:
    """Process entry point: detokenize engine steps until killed."""
    init_child(log_level, "detokenizer", server_pid)
    ctx = zmq.Context()
    steps = pull(ctx, addresses.detokenizer, bind=True)
    to_api = push(ctx, addresses.api, bind=False)
    to_engine = push(ctx, addresses.engine, bind=False)
    started = time.perf_counter()
    detok = Detokenizer(load_tokenizer(tokenizer_path))
    # When the engine core's ready can pass (its first stats come through here): with the
    # line's time, whether a late ready was the fork or the load (`ready_message` phase).
    logger.info("detokenizer up: tokenizer loaded in %.2f s", time.perf_counter() - started)
    decoder = msgspec.msgpack.Decoder(EngineStep)
    while True:
        raw = steps.recv()
        try:
            step = decoder.decode(raw)
        except msgspec.DecodeError:
            # A bug in the engine core, not a request's fault: nothing to answer, keep going.
            logger.exception("dropped an undecodable engine step (%d bytes)", len(raw))
            continue
        batch, stopped, failed = detok.process(step)
        if stopped:
            to_engine.send(encode(AbortRequest(stopped, reason="stop")))
        if failed:
            to_engine.send(encode(AbortRequest(failed)))
        to_api.send(encode(batch))


class Detokenizer:
    """Per-request choice streams; one engine step in, one client batch out.

    Whatever goes wrong with one request's output (a token id the tokenizer can not decode, a
    bug) becomes an error for that request alone; the others, and the process, carry on.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, ChoiceStream] = {}
        # The first prompt token of each request asking for prompt logprobs, until they go out.
        self.first_tokens: dict[str, int] = {}
        self._engine_pid: int | None = None

    def process(self, step: EngineStep) -> tuple[ClientBatch, list[str], list[str]]:
        """The batch for the api server, the requests a stop string just ended, and the
        requests whose output failed (to abort in the engine)."""
        if step.stats.engine_pid != self._engine_pid:
            # A restarted engine core: the requests of the old one are gone (and failed).
            self._engine_pid = step.stats.engine_pid
            self.streams.clear()
            self.first_tokens.clear()
        errors = list(step.errors)
        for new in step.new_requests:
            try:
                self.streams[new.request_id] = ChoiceStream(
                    self.tokenizer, new.prompt_token_ids, new.params
                )
                if new.params.prompt_logprobs is not None:
                    self.first_tokens[new.request_id] = new.prompt_token_ids[0]
            except Exception as exc:  # one request's failure stays its own
                errors.append(_failure(new.request_id, exc))
        outputs, stopped = [], []
        for delta in step.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                continue
            try:
                update = stream.update(delta.new_token_ids, delta.finish_reason)
                out = None if update is None else self._output(delta, update)
            except Exception as exc:  # one request's failure stays its own
                self._forget(delta.request_id)
                errors.append(_failure(delta.request_id, exc))
                continue
            if update is not None and update.finish_reason is not None:
                self._forget(delta.request_id)
            if update is not None and update.stop_matched:
                stopped.append(delta.request_id)
            if out is not None:
                outputs.append(out)
        for error in step.errors:
            self._forget(error.request_id)
        failed = [e.request_id for e in errors[len(step.errors) :]]
        started = [new.request_id for new in step.new_requests]
        return ClientBatch(outputs, errors, step.stats, started), stopped, failed

    def _forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.first_tokens.pop(request_id, None)

    def _output(self, delta: RequestDelta, update: ChoiceUpdate) -> ClientOutput:
        logprobs = delta.logprobs if update.token_ids else None
        if logprobs is not None:  # none for tokens after a stop string (`ChoiceStream`)
            logprobs = logprobs[: len(update.token_ids)]
        return ClientOutput(
            request_id=delta.request_id,
            text=update.text,
            token_ids=update.token_ids,
            logprobs=self._logprobs(logprobs),
            finish_reason=update.finish_reason,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            metrics=delta.metrics,
            prompt_logprobs=self._prompt_logprobs(delta),
        )

    def _prompt_logprobs(self, delta: RequestDelta) -> PromptTextLogprobs | None:
        """The prompt's logprobs with token texts (a request's first output, if asked)."""
        first = self.first_tokens.pop(delta.request_id, None)
        if delta.prompt_logprobs is None or first is None:
            return None
        entries = self._logprobs([e for e in delta.prompt_logprobs[1:] if e is not None])
        assert entries is not None
        return PromptTextLogprobs((first, self._token_text(first)), entries)

    def _logprobs(self, logprobs: list[TokenLogprobs] | None) -> list[TextLogprobs] | None:
        if logprobs is None:
            return None
        return [
            [(tid, self._token_text(tid), lp, rank) for tid, lp, rank in entry]
            for entry in logprobs
        ]

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id])


def _failure(request_id: str, exc: Exception) -> RequestError:
    logger.error("request %s failed in the detokenizer: %r", request_id, exc, exc_info=exc)
    return RequestError(request_id, f"detokenizing the output failed: {exc!r}", status=500)
