"""Starts a real `tokenmill serve` subprocess for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL_NAME = "tiny"


@dataclass
class ServerHandle:
    base_url: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def child_pids(self) -> dict[str, int]:
        """Child process name → pid, from the start-up log."""
        return {m[0]: int(m[1]) for m in re.findall(r"started (\S+) \(pid (\d+)\)", self.log)}

    def group_processes(self) -> list[GroupProcess]:
        """The running processes of the server's process group (zombies left out), the server
        itself included, wherever they were reparented."""
        return group_processes(self.proc.pid)


@dataclass(frozen=True)
class GroupProcess:
    pid: int
    ppid: int
    title: str  # the first word of its command line: `tokenmill::tokenizer_0`, `python`, ...
    command: str  # its whole command line, words joined by spaces


def group_processes(pgid: int) -> list[GroupProcess]:
    """The running processes (zombies left out) of process group `pgid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            words = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # ended meanwhile
        state, ppid, group = stat.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state not in ("Z", "X"):
            command = " ".join(w for w in words if w)
            found.append(GroupProcess(int(entry.name), int(ppid), words[0].strip(), command))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(model_dir: Path, log_path: Path, *extra: str) -> ServerHandle:
    """`tokenmill serve` of `model_dir` on a free port, in a session of its own, logging to
    `log_path`; returns at once (see `run_server`)."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", str(model_dir),
        "--port", str(port), "--served-model-name", MODEL_NAME, "--device", "cpu", *extra,
    ]  # fmt: skip
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return ServerHandle(f"http://127.0.0.1:{port}", proc, log_path)


@contextlib.contextmanager
def run_server(model_dir: Path, log_path: Path, *extra: str) -> Iterator[ServerHandle]:
    """A healthy server (`launch_server`), stopped (SIGTERM, then SIGKILL) at the end."""
    handle = launch_server(model_dir, log_path, *extra)
    proc = handle.proc
    try:
        _wait_healthy(handle)
        yield handle
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(handle: ServerHandle, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.proc.poll() is not None:
            raise RuntimeError(f"server exited with {handle.proc.returncode}:\n{handle.log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(handle.base_url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{handle.log}")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def socket_folders(root: Path) -> list[Path]:
    """tokenmill's socket folders under `root` (multiprocessing may keep its own `pymp-*`)."""
    return list(root.glob("tokenmill-*"))


def server_fixture(*flags: str) -> object:
    """A module-scoped pytest fixture: a server of the tiny Llama checkpoint (`llama_dir`)
    started with `flags`, its log in a temporary folder."""

    @pytest.fixture(scope="module")
    def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
        log = tmp_path_factory.mktemp("logs") / "server.log"
        with run_server(llama_dir, log, *flags) as handle:
            yield handle

    return server


def post_json_or_stream(server: ServerHandle, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST `body`: the status and the body, JSON, or a stream's chunks (a list) when streamed
    (which must end with `[DONE]` and hold no error event)."""
    if not body.get("stream"):
        response = httpx.post(server.base_url + path, json=body, timeout=60)
        return response.status_code, response.json()
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as response:
        if response.status_code != 200:
            return response.status_code, json.loads(response.read())
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return 200, chunks
