"""ZeroMQ PUSH/PULL sockets on ipc:// paths, with msgpack framing."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq


@dataclass(frozen=True)
class Addresses:
    """Where each process listens: one PULL socket per receiving process."""

    engine: str  # engine core's inputs (requests from tokenizers, aborts)
    detokenizer: str  # engine core's step outputs
    api: str  # outputs and errors for the api server
    tokenizer: str  # requests from the api server to the tokenizer workers

    @staticmethod
    def fresh() -> Addresses:
        root = tempfile.mkdtemp(prefix="tokenmill-")
        return Addresses(
            *(f"ipc://{os.path.join(root, name)}" for name in ("engine", "detok", "api", "tok"))
        )


def pull(ctx: zmq.Context, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address) if bind else sock.connect(address)
    return sock


def push(ctx: zmq.Context, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address) if bind else sock.connect(address)
    return sock


_encoder = msgspec.msgpack.Encoder()


def encode(message: Any) -> bytes:
    return _encoder.encode(message)
