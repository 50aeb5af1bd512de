"""Process failures and shutdown: SIGTERM (and SIGHUP, which is one) ends requests cleanly, at
any time, start-up included; children die with the server.

(A killed engine core, tokenizer or detokenizer: tests/reliability/test_workers_supervision.py.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import (
    MODEL_NAME,
    ServerHandle,
    launch_server,
    run_server,
    socket_folders,
    wait_until,
)

# Eight long choices per request keep the engine busy for seconds, so the requests are surely
# still running when the test kills or stops the server.
LONG = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 1000, "n": 8, "ignore_eos": True}


def _alive(pid: int) -> bool:
    """True if `pid` runs (a zombie waiting to be reaped counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_sigterm_finishes_in_flight_requests_and_exits(llama_dir: Path, tmp_path: Path) -> None:
    with run_server(llama_dir, tmp_path / "log", "--max-model-len", "1024") as server:
        children = server.child_pids()
        assert set(children) == {"engine-core", "detokenizer", "tokenizer-0"}
        lines, thread = _stream_in_background(server.base_url)
        assert wait_until(lambda: len(lines) > 0 or _running(server.base_url))
        server.proc.send_signal(signal.SIGTERM)
        thread.join(timeout=15)
        assert server.proc.wait(timeout=20) == 0
        assert '"finish_reason": "abort"' in "\n".join(lines)
        assert "data: [DONE]" in lines
        assert wait_until(lambda: not any(_alive(p) for p in children.values()), timeout=10)


def test_sigterm_to_the_process_group_is_a_clean_shutdown(llama_dir: Path, tmp_path: Path) -> None:
    """systemd (and `kill -- -PGID`) signal every process of the server: the workers that die
    of it are not restarted nor errors; their requests end with an error, the server with 0."""
    extra = ("--max-model-len", "1024", "--restart-engine", "--num-tokenizer-workers", "2")
    with run_server(llama_dir, tmp_path / "log", *extra) as server:
        children = server.child_pids()
        lines, thread = _stream_in_background(server.base_url)
        assert wait_until(lambda: len(lines) > 0)
        os.killpg(server.proc.pid, signal.SIGTERM)
        started = time.monotonic()
        thread.join(timeout=15)
        assert server.proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 5
        assert "data: [DONE]" in lines
        assert " ERROR " not in server.log and "restarted" not in server.log
        assert server.child_pids() == children  # nothing was started again
        assert wait_until(lambda: not any(_alive(p) for p in children.values()), timeout=10)


@pytest.mark.parametrize("to_group", [False, True], ids=["server", "group"])
def test_sighup_is_a_sigterm(
    llama_dir: Path, tmp_path: Path, socket_root: Path, to_group: bool
) -> None:
    """A closed terminal or ssh session hangs the server up (and, its group, the workers):
    in-flight requests end cleanly, the server with 0 and its sockets removed."""
    with run_server(llama_dir, tmp_path / "log", "--max-model-len", "1024") as server:
        lines, thread = _stream_in_background(server.base_url)
        assert wait_until(lambda: len(lines) > 0)
        (os.killpg if to_group else os.kill)(server.proc.pid, signal.SIGHUP)
        thread.join(timeout=15)
        assert server.proc.wait(timeout=20) == 0
        assert "data: [DONE]" in lines
        assert wait_until(lambda: _ended(server, socket_root), timeout=10), _left(server)


@pytest.mark.parametrize("to_group", [False, True], ids=["server", "group"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_a_stop_signal_during_start_up_stops_every_process_and_removes_the_sockets(
    llama_dir: Path, tmp_path: Path, socket_root: Path, signum: int, to_group: bool
) -> None:
    server = launch_server(llama_dir, tmp_path / "log")
    try:
        # The engine core, the fork server and its workers start ahead of the server's imports.
        assert wait_until(lambda: "started engine-core" in server.log, timeout=30), server.log
        (os.killpg if to_group else os.kill)(server.proc.pid, signum)
        assert server.proc.wait(timeout=20) == 0, server.log
        assert "stopped by SIGTERM while starting" in server.log
        assert wait_until(lambda: _ended(server, socket_root), timeout=10), _left(server)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def _ended(server: ServerHandle, socket_root: Path) -> bool:
    """Every process of the server's group ended, its socket folder removed."""
    return not server.group_processes() and not socket_folders(socket_root)


def _left(server: ServerHandle) -> list[str]:
    return [process.command[:80] for process in server.group_processes()]


def _stream_in_background(base_url: str) -> tuple[list[str], threading.Thread]:
    """A long streamed completion on a thread of its own: the lines it has read so far (a
    list that grows) and the thread."""
    lines: list[str] = []

    def streaming() -> None:
        body = {**LONG, "stream": True}
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30) as r:
            lines.extend(r.iter_lines())

    thread = threading.Thread(target=streaming)
    thread.start()
    return lines, thread


def _running(base_url: str) -> bool:
    return httpx.get(base_url + "/load").json().get("num_requests_running", 0) > 0


def test_children_exit_when_the_server_is_killed(llama_dir: Path, tmp_path: Path) -> None:
    with run_server(llama_dir, tmp_path / "log") as server:
        children = server.child_pids()
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        assert wait_until(lambda: not any(_alive(p) for p in children.values()), timeout=10)


@pytest.mark.parametrize("bad", [["--num-pages", "1"], ["--dtype", "int4"]])
def test_bad_engine_options_fail_at_startup(llama_dir: Path, tmp_path: Path, bad) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", str(llama_dir), *bad],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "error" in result.stderr.lower()
