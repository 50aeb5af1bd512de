"""ZeroMQ PUSH/PULL sockets on ipc:// paths in one folder, with msgpack framing.

Every receiving process binds its PULL socket and senders connect, so that a restarted process
binds the same path again and its senders reconnect on their own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq


@dataclass(frozen=True)
class Addresses:
    """Where each process listens: one PULL socket per receiving process, all in `root`."""

    root: str  # the folder of the socket files; removed by `remove()`
    engine: str  # engine core's inputs (requests from tokenizers, aborts)
    detokenizer: str  # engine core's step outputs
    api: str  # outputs and errors for the api server
    tokenizers: tuple[str, ...]  # requests from the api server, one socket per tokenizer worker

    @staticmethod
    def fresh(num_tokenizers: int) -> Addresses:
        """Addresses in a new private folder under the temporary directory."""
        root = tempfile.mkdtemp(prefix="tokenmill-")

        def address(name: str) -> str:
            return f"ipc://{os.path.join(root, name)}"

        tokenizers = tuple(address(f"tok-{i}") for i in range(num_tokenizers))
        return Addresses(root, address("engine"), address("detok"), address("api"), tokenizers)

    def remove(self) -> None:
        """Delete the socket folder (when every process is done with it)."""
        shutil.rmtree(self.root, ignore_errors=True)


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


def request_id_of(raw: bytes) -> str | None:
    """The `request_id` of a message that did not decode as its type, if it has one."""
    try:
        fields = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    request_id = fields.get("request_id") if isinstance(fields, dict) else None
    return request_id if isinstance(request_id, str) else None
