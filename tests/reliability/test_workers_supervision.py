"""Worker supervision: kill -9 of each worker, process titles, the socket folder at exit."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server, socket_folders, wait_until

# Long choices keep the engine busy, so the requests are surely in flight when a worker dies.
LONG = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 1000, "n": 4, "ignore_eos": True}
SHORT = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4}


def _post(server: ServerHandle, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=timeout)


def _in_flight(server: ServerHandle, results: dict[str, object]) -> list[threading.Thread]:
    """A non-streamed and a streamed long request, running once this returns."""
    streaming_started = threading.Event()

    def plain() -> None:
        results["plain"] = _post(server, LONG)

    def streamed() -> None:
        lines = results["stream"] = []
        body = {**LONG, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                streaming_started.set()

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    assert streaming_started.wait(timeout=60)
    assert wait_until(lambda: _load(server).get("num_requests_running") == 8, timeout=30)
    return threads


def _load(server: ServerHandle) -> dict:
    return httpx.get(server.base_url + "/load", timeout=10).json()


def _restarted(server: ServerHandle, name: str, old_pid: int) -> bool:
    return server.child_pids()[name] != old_pid


@pytest.mark.parametrize("worker", ["tokenizer-0", "detokenizer"])
def test_killed_worker_is_back_within_5s_and_the_next_request_succeeds(
    llama_dir: Path, tmp_path: Path, worker: str
) -> None:
    with run_server(llama_dir, tmp_path / "log") as server:
        pid = server.child_pids()[worker]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert wait_until(lambda: _restarted(server, worker, pid), timeout=5)
        response = _post(server, SHORT)
        assert response.status_code == 200, response.text
        assert time.monotonic() - killed_at < 5
        assert response.json()["choices"][0]["finish_reason"] == "length"
        assert f"{worker} (pid {pid}) died with exit code -9; restarted it" in server.log
        assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("killed", ["detokenizer", "fork server"])
def test_killed_detokenizer_fails_its_in_flight_requests_and_frees_their_pages(
    llama_dir: Path, tmp_path: Path, killed: str
) -> None:
    """A dead fork server's detokenizer (orphaned, running on) is killed and restarted alike."""
    with run_server(llama_dir, tmp_path / "log", "--max-model-len", "1024") as server:
        results: dict[str, object] = {}
        threads = _in_flight(server, results)
        if killed == "detokenizer":
            os.kill(server.child_pids()["detokenizer"], signal.SIGKILL)
        else:
            _kill_fork_server(server, set())
        killed_at = time.monotonic()
        for t in threads:
            t.join(timeout=10)
        assert time.monotonic() - killed_at < 5
        plain = results["plain"]
        message = plain.json()["error"]["message"]
        assert plain.status_code == 503 and "detokenizer" in message and killed in message
        lines = results["stream"]
        assert any('"error"' in line for line in lines) and "data: [DONE]" in lines
        # Their choices were aborted in the engine: nothing is left running.
        assert wait_until(lambda: _load(server).get("num_requests_running") == 0, timeout=10)
        assert _post(server, SHORT).status_code == 200


def test_killed_engine_core_fails_requests_and_the_server_exits_nonzero_within_5s(
    llama_dir: Path, tmp_path: Path, socket_root: Path
) -> None:
    with run_server(llama_dir, tmp_path / "log", "--max-model-len", "1024") as server:
        engine_pid = server.child_pids()["engine-core"]
        results: dict[str, object] = {}
        threads = _in_flight(server, results)
        os.kill(engine_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(timeout=10)
        plain = results["plain"]
        assert plain.status_code == 500 and "engine-core" in plain.json()["error"]["message"]
        lines = results["stream"]
        assert any('"error"' in line for line in lines) and "data: [DONE]" in lines
        assert server.proc.wait(timeout=10) == 1
        assert time.monotonic() - killed_at < 5
        assert f"engine-core (pid {engine_pid}) died with exit code -9; exiting" in server.log
        assert list(socket_root.iterdir()) == []  # the socket folder is gone


def test_restart_engine_restarts_it_in_place(llama_dir: Path, tmp_path: Path) -> None:
    extra = ("--max-model-len", "1024", "--restart-engine")
    with run_server(llama_dir, tmp_path / "log", *extra) as server:
        engine_pid = server.child_pids()["engine-core"]
        results: dict[str, object] = {}
        threads = _in_flight(server, results)
        os.kill(engine_pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=10)
        assert results["plain"].status_code == 500
        assert "restarting" in results["plain"].json()["error"]["message"]
        assert wait_until(lambda: _restarted(server, "engine-core", engine_pid), timeout=5)
        assert wait_until(
            lambda: httpx.get(server.base_url + "/health").status_code == 200, timeout=60
        )
        assert _post(server, SHORT).status_code == 200
        assert server.proc.poll() is None


def test_workers_have_process_titles_and_sockets_are_removed_at_exit(
    llama_dir: Path, tmp_path: Path, socket_root: Path
) -> None:
    with run_server(llama_dir, tmp_path / "log", "--num-tokenizer-workers", "2") as server:
        pids = server.child_pids()
        expected = {
            "engine-core": "tokenmill::engine_core",
            "detokenizer": "tokenmill::detokenizer",
            "tokenizer-0": "tokenmill::tokenizer_0",
            "tokenizer-1": "tokenmill::tokenizer_1",
        }
        # The server is healthy once the engine is; a tokenizer worker started beside it may
        # still be importing, before it titles itself.
        wait_until(lambda: {n: _title(p) for n, p in pids.items()} == expected, timeout=30)
        assert {name: _title(pid) for name, pid in pids.items()} == expected
        assert len(socket_folders(socket_root)) == 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
    assert socket_folders(socket_root) == []


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()


WORKER_TITLES = [
    "tokenmill::detokenizer",
    "tokenmill::engine_core",
    "tokenmill::tokenizer_0",
    "tokenmill::tokenizer_1",
]


def _worker_pids(server: ServerHandle) -> dict[str, list[int]]:
    """Every running tokenmill worker of the server's process group, by title."""
    workers: dict[str, list[int]] = {}
    for process in server.group_processes():
        if process.title.startswith("tokenmill::"):
            workers.setdefault(process.title, []).append(process.pid)
    return dict(sorted(workers.items()))


def _kill_fork_server(server: ServerHandle, not_these: set[int]) -> int:
    """SIGKILL the server's fork server, once one that is not in `not_these` runs; its pid."""
    found: list[int] = []

    def started() -> bool:
        found[:] = [
            p.pid
            for p in server.group_processes()
            if p.ppid == server.proc.pid
            and "multiprocessing.forkserver" in p.command
            and p.pid not in not_these
        ]
        return bool(found)

    assert wait_until(started, timeout=5, interval=0.001)
    os.kill(found[0], signal.SIGKILL)
    return found[0]


def _one_of_each(server: ServerHandle, old: dict[str, list[int]]) -> bool:
    """Exactly one of each worker, the forked ones new (the engine core the same)."""
    now = _worker_pids(server)
    if sorted(now) != WORKER_TITLES or any(len(pids) != 1 for pids in now.values()):
        return False
    forked = [title for title in WORKER_TITLES if title != "tokenmill::engine_core"]
    return (
        all(now[t] != old[t] for t in forked)
        and now["tokenmill::engine_core"] == old["tokenmill::engine_core"]
    )


@pytest.mark.parametrize("kills", [1, 2], ids=["once", "again while restarting"])
def test_killed_fork_server_leaves_one_of_each_worker_and_the_server_answers(
    llama_dir: Path, tmp_path: Path, kills: int
) -> None:
    """Its workers lived on, orphaned, beside the ones started in their place. Killed again,
    the fork server the supervisor starts to restart them dies while importing their modules,
    before forking any: the restart's first try fails (it ended the supervisor's watch)."""
    with run_server(llama_dir, tmp_path / "log", "--num-tokenizer-workers", "2") as server:
        assert wait_until(lambda: sorted(_worker_pids(server)) == WORKER_TITLES, timeout=30)
        old = _worker_pids(server)
        killed: set[int] = set()
        for _ in range(kills):
            killed.add(_kill_fork_server(server, killed))
        assert wait_until(lambda: _one_of_each(server, old), timeout=10), _worker_pids(server)
        assert _post(server, SHORT).status_code == 200
        assert "lost its fork server" in server.log
        assert httpx.get(server.base_url + "/health").status_code == 200
