"""Detokenizer process: turns engine steps into text deltas, applies stop strings."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import zmq
from transformers import PreTrainedTokenizerBase

from tokenmill.ipc.messages import (
    AbortRequest,
    ClientBatch,
    ClientOutput,
    EngineStep,
    NewRequest,
    RequestDelta,
    TokenLogprobs,
)
from tokenmill.ipc.process import init_child
from tokenmill.ipc.sockets import Addresses, encode, pull, push
from tokenmill.tokenization.detokenizer import IncrementalDetokenizer
from tokenmill.tokenization.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def run_detokenizer(
    tokenizer_path: str, addresses: Addresses, log_level: str, parent_pid: int
) -> None:
    """Process entry point: detokenize engine steps until killed."""
    init_child(log_level, parent_pid)
    ctx = zmq.Context()
    steps = pull(ctx, addresses.detokenizer, bind=True)
    to_api = push(ctx, addresses.api, bind=False)
    to_engine = push(ctx, addresses.engine, bind=False)
    detok = Detokenizer(load_tokenizer(tokenizer_path))
    decoder = msgspec.msgpack.Decoder(EngineStep)
    while True:
        batch, stopped = detok.process(decoder.decode(steps.recv()))
        if stopped:
            to_engine.send(encode(AbortRequest(stopped, reason="stop")))
        to_api.send(encode(batch))


@dataclass
class _Stream:
    detokenizer: IncrementalDetokenizer | None
    stopped: bool = False  # a stop string matched; waiting for the engine's final output


class Detokenizer:
    """Per-request incremental detokenizers; one engine step in, one client batch out."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}

    def process(self, step: EngineStep) -> tuple[ClientBatch, list[str]]:
        """Returns the batch for the api server and the requests a stop string just ended."""
        for new in step.new_requests:
            self._open(new)
        outputs, stopped = [], []
        for delta in step.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                continue
            was_stopped = stream.stopped
            out = self._decode(delta, stream)
            if stream.stopped and not was_stopped and delta.finish_reason is None:
                stopped.append(delta.request_id)
            if out is not None:
                outputs.append(out)
        for error in step.errors:
            self.streams.pop(error.request_id, None)
        return ClientBatch(outputs, step.errors, step.stats), stopped

    def _open(self, new: NewRequest) -> None:
        detok = None
        if self.tokenizer is not None:
            p = new.params
            detok = IncrementalDetokenizer(
                self.tokenizer,
                new.prompt_token_ids,
                p.stop,
                p.include_stop_str_in_output,
                p.skip_special_tokens,
            )
        self.streams[new.request_id] = _Stream(detok)

    def _decode(self, delta: RequestDelta, stream: _Stream) -> ClientOutput | None:
        """The client's view of an engine delta; None for tokens after a matched stop string.

        When a stop string matches, the text up to it goes out at once and the request is
        aborted; the engine's final output (its metrics) then closes the stream as "stop".
        """
        finish = delta.finish_reason
        if stream.stopped:
            if finish is None:
                return None
            del self.streams[delta.request_id]
            return ClientOutput(delta.request_id, "", [], None, "stop", delta.num_prompt_tokens,
                                delta.num_cached_tokens, delta.metrics)  # fmt: skip
        text = ""
        if stream.detokenizer is not None:
            update = stream.detokenizer.update(delta.new_token_ids, final=finish is not None)
            text = update.text
            if update.stopped:
                if finish is None:
                    stream.stopped = True
                else:
                    finish = "stop"
        if finish is not None:
            del self.streams[delta.request_id]
        return ClientOutput(
            request_id=delta.request_id,
            text=text,
            token_ids=delta.new_token_ids,
            logprobs=self._logprobs(delta.logprobs),
            finish_reason=finish,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            metrics=delta.metrics,
        )

    def _logprobs(
        self, logprobs: list[TokenLogprobs] | None
    ) -> list[list[tuple[int, str, float, int]]] | None:
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
