"""One replica: a full `tokenmill serve` stack in a child process, and the Ray Serve deployment
that proxies requests to it.

The child is the unchanged single-process server (api server, tokenizer workers, engine core,
detokenizer) on a free port of this node; it dies with the replica (`PR_SET_PDEATHSIG`, and its
own workers watch its pid). Ray Serve's graceful shutdown drains a replica (no new requests;
in-flight ones finish, up to `graceful_shutdown_timeout_s`) before `__del__` stops the child.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from ray import serve
from ray.util import get_node_ip_address

from tokenmill.deploy.directory import directory
from tokenmill.deploy.routing import RoutedRequest

logger = logging.getLogger("tokenmill.deploy")

REPLICA_HEADER = "x-tokenmill-replica"
# Response headers a replica passes on (the rest are the child's transport's, e.g. length).
PASSED_HEADERS = frozenset({"content-type", "retry-after", "x-request-id"})
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: receive SIGKILL when the replica process ends (Linux)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class TokenmillReplica:
    """A Ray Serve replica running `tokenmill serve <server_argv>` and proxying to it."""

    def __init__(self, server_argv: Sequence[str], app_name: str, startup_timeout_s: float) -> None:
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        host = get_node_ip_address()
        port = _free_port(host)
        self.url = f"http://{host}:{port}"
        command = [sys.executable, "-m", "tokenmill", "serve", *server_argv]
        command += ["--host", host, "--port", str(port)]
        # The child's output goes to a file of its own, whose end a start-up failure quotes.
        self.log_path = Path(tempfile.mkstemp(prefix="tokenmill-replica-", suffix=".log")[1])
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        self._wait_healthy(startup_timeout_s)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=None)
        self.directory = directory(app_name)
        self.directory.register.remote(self.replica_id, self.url)
        logger.info("replica %s serving at %s (log: %s)", self.replica_id, self.url, self.log_path)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"tokenmill serve exited with code {code}:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.process.kill()
        raise RuntimeError(
            f"tokenmill serve not healthy after {timeout_s:.0f} s:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def generate(self, request: RoutedRequest) -> AsyncIterator[Any]:
        """Streams: this replica's id, then the response head (status, headers), then the body
        in the chunks the server sends (an SSE stream stays a stream)."""
        yield {"replica": self.replica_id}
        headers = [(k, v) for k, v in request.headers if k not in ("host", "content-length")]
        url = request.path + (f"?{request.query}" if request.query else "")
        async with self.client.stream(
            request.method, url, content=request.body, headers=headers
        ) as response:
            passed = [(k, v) for k, v in response.headers.items() if k.lower() in PASSED_HEADERS]
            yield {
                "status": response.status_code,
                "headers": [*passed, (REPLICA_HEADER, self.replica_id)],
            }
            async for chunk in response.aiter_raw():
                yield chunk

    def check_health(self) -> None:
        """Ray Serve's health check: the child server must be alive."""
        if self.process.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with code {self.process.returncode}")

    def __del__(self) -> None:
        # Reached after Ray Serve drained this replica: nothing is in flight any more.
        process = getattr(self, "process", None)
        if getattr(self, "directory", None) is not None:
            self.directory.unregister.remote(self.replica_id)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
