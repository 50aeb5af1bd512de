"""Tokenizer worker process: renders chats, tokenizes, validates lengths, fans out `n` choices."""

from __future__ import annotations

import logging

import msgspec
import zmq

from tokenmill.ipc.messages import ClientBatch, EngineRequest, RequestError, TokenizeRequest
from tokenmill.ipc.process import init_child
from tokenmill.ipc.sockets import Addresses, encode, pull, push
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenization.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """The prompt (plus the requested completion) does not fit in the context window."""


def check_length(num_prompt: int, params: SamplingParams, max_model_len: int) -> None:
    """Raise if the prompt, or prompt + max_tokens, exceeds the context window."""
    if num_prompt >= max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt} tokens, which leaves no room for a completion."
        )
    if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
            f"{params.max_tokens} in the completion). Reduce the prompt or max_tokens."
        )


def run_tokenizer_worker(
    tokenizer_path: str, max_model_len: int, addresses: Addresses, log_level: str, parent_pid: int
) -> None:
    """Process entry point: tokenize requests from the api server until killed."""
    init_child(log_level, parent_pid)
    tokenizer = load_tokenizer(tokenizer_path)
    ctx = zmq.Context()
    requests = pull(ctx, addresses.tokenizer, bind=False)
    to_engine = push(ctx, addresses.engine, bind=False)
    to_api = push(ctx, addresses.api, bind=False)
    decoder = msgspec.msgpack.Decoder(TokenizeRequest)
    while True:
        req = decoder.decode(requests.recv())
        try:
            if req.messages is not None:
                ids = apply_chat_template(tokenizer, req.messages)
            else:
                assert req.prompt is not None
                ids = encode_prompt(tokenizer, req.prompt, req.add_special_tokens)
            check_length(len(ids), req.params, max_model_len)
        except ValueError as exc:
            param = "messages" if req.messages is not None else "prompt"
            error = RequestError(req.request_id, str(exc), status=400, param=param)
            to_api.send(encode(ClientBatch(outputs=[], errors=[error])))
            continue
        for index in range(req.params.n):
            to_engine.send(
                encode(
                    EngineRequest(f"{req.request_id}:{index}", ids, req.params.for_choice(index))
                )
            )
