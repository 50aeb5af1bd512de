"""A `tokenmill serve` child process for benchmarks: launched with the environment they choose
(e.g. every on-disk cache under a folder of their own, empty for a cold start), timed from
launch to listening, ready and its first successful completion, read for its start-up phases,
and stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

# A prompt every tokenizer can encode; its completion runs prefill and decode steps.
FIRST_PROMPT = "The first request after a start"
FIRST_MAX_TOKENS = 16
_PHASE = re.compile(r"^tokenmill:startup_seconds\{([^}]*)\} (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_STARTUP_LINE = re.compile(r"start-up \d+\.\d+ s \(.*\)")
_PENDING = re.compile(r"^tokenmill:cuda_graphs_pending\{[^}]*\} (\S+)$", re.M)


def cache_environment(root: Path) -> dict[str, str]:
    """Environment variables that put every on-disk cache a start-up reads or fills under
    `root`: tokenmill's tuning cache (the default `--tuning-cache-dir`, under
    `$XDG_CACHE_HOME`), Triton's compiled kernels, torch inductor's, CUDA's JIT cache, torch
    extensions and FlashInfer's JIT builds."""
    return {
        "XDG_CACHE_HOME": str(root),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "torchinductor"),
        "CUDA_CACHE_PATH": str(root / "nv"),
        "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
        "FLASHINFER_WORKSPACE_BASE": str(root),
    }


def drop_from_page_cache(directory: Path) -> int:
    """Ask the kernel to drop `directory`'s files from the OS page cache (flushed first, so
    that pages just written can go); the bytes of the files it was asked for."""
    dropped = 0
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return dropped


def cache_files(root: Path) -> dict[str, int]:
    """Files under each folder of `root` (tokenmill's tuning cache counted apart)."""
    counts: dict[str, int] = {}
    for path in root.rglob("*"):
        if path.is_file():
            relative = path.relative_to(root).parts
            folder = "tuning" if relative[:2] == ("tokenmill", "tuning") else relative[0]
            counts[folder] = counts.get(folder, 0) + 1
    return dict(sorted(counts.items()))


@dataclass(frozen=True)
class StartTimes:
    """Seconds from launching `tokenmill serve` until it first answered HTTP (503 while the
    model loads), until /health said ready, and until its first completion succeeded."""

    listening_s: float
    ready_s: float
    first_completion_s: float


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def startup_phases(metrics_text: str) -> dict[str, float]:
    """`tokenmill:startup_seconds{phase}` of a /metrics page, in the order it lists them."""
    phases: dict[str, float] = {}
    for labels, value in _PHASE.findall(metrics_text):
        phase = dict(_LABEL.findall(labels)).get("phase")
        if phase is not None:
            phases[phase] = float(value)
    return phases


def startup_log_line(log_text: str) -> str | None:
    """The server log's line of start-up phases (`start-up 12.34 s (...)`), if it has one."""
    found = _STARTUP_LINE.findall(log_text)
    return found[-1] if found else None


class ServerProcess:
    """`tokenmill serve MODEL_DIR *serve_args` on 127.0.0.1, its output in `log_path`."""

    def __init__(
        self, model_dir: str, serve_args: Sequence[str], log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "tokenmill", "serve", model_dir, *serve_args]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.command = command
        self._env = {**os.environ, **(env or {})}
        self._process: subprocess.Popen[bytes] | None = None
        self._launched = 0.0

    def start(self) -> None:
        """Launch the server (the clock of `wait_first_completion` starts now)."""
        with self.log_path.open("wb") as log:
            self._launched = time.perf_counter()
            # A session of its own: a Ctrl-C meant for the benchmark reaches it through stop().
            self._process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                start_new_session=True,
            )  # fmt: skip

    def wait_first_completion(self, timeout_s: float) -> StartTimes:
        """Poll (every 50 ms) until a completion succeeds; RuntimeError, quoting the log's end,
        if the server exits, answers a completion with an error other than 503, or takes
        longer than `timeout_s`."""
        listening = ready = None
        model = None
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            while (now := self._elapsed()) < timeout_s:
                self._check_running()
                try:
                    if ready is None:
                        health = client.get("/health", timeout=2)
                        answered = self._elapsed()
                        listening = answered if listening is None else listening
                        ready = answered if health.status_code == 200 else None
                    else:
                        model = model or client.get("/v1/models").json()["data"][0]["id"]
                        if self._complete(client, model, timeout_s - now):
                            assert listening is not None  # answered before it was ready
                            return StartTimes(listening, ready, self._elapsed())
                except httpx.TransportError:  # not listening yet
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"no completion {timeout_s:.0f} s after launch:\n{self.log_tail()}")

    def wait_graphs_captured(self, timeout_s: float) -> float:
        """Poll /metrics (every 100 ms) until the engine has no CUDA graph or build ahead left
        to capture in the background (`tokenmill:cuda_graphs_pending`; a step that needs one
        waits for its capture, so a throughput measured earlier counts captures); returns the
        seconds waited. RuntimeError if the server exits or `timeout_s` passes."""
        start = time.perf_counter()
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            while (waited := time.perf_counter() - start) < timeout_s:
                self._check_running()
                try:
                    pending = _PENDING.search(client.get("/metrics").text)
                except httpx.TransportError:  # busy or going away: the next poll tells
                    pending = None
                if pending is not None and float(pending[1]) == 0:
                    return waited
                time.sleep(0.1)
        raise RuntimeError(f"CUDA graphs still pending after {timeout_s:.0f} s")

    def _elapsed(self) -> float:
        return time.perf_counter() - self._launched

    def _complete(self, client: httpx.Client, model: str, timeout_s: float) -> bool:
        body = {
            "model": model, "prompt": FIRST_PROMPT, "max_tokens": FIRST_MAX_TOKENS,
            "temperature": 0, "ignore_eos": True,
        }  # fmt: skip
        # The first completion may compile kernels: it may take the time left.
        response = client.post("/v1/completions", json=body, timeout=max(timeout_s, 1.0))
        if response.status_code == 503:  # still starting (or restarting its engine)
            return False
        if response.status_code != 200:
            raise RuntimeError(
                f"the first completion failed: HTTP {response.status_code} {response.text[:300]}"
            )
        return True

    def _check_running(self) -> None:
        if self._process is None:
            raise RuntimeError("the server was not started")
        if self._process.poll() is not None:
            raise RuntimeError(
                f"tokenmill serve exited with code {self._process.returncode}:\n{self.log_tail()}"
            )

    def startup_phases(self) -> dict[str, float]:
        """The server's `tokenmill:startup_seconds{phase}` (set once it is ready)."""
        return startup_phases(httpx.get(self.base_url + "/metrics", timeout=30).text)

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's output."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (a graceful shutdown), SIGKILL to it and its workers after `timeout_s`;
        returns its exit code once no process of its group runs (so that the device memory its
        engine held is free for whatever runs next). Stopping it again returns the same code."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        deadline = time.monotonic() + timeout_s
        while _group_running(process.pid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        return process.returncode


def _group_running(group: int) -> bool:
    """Whether a process of process group `group` runs (zombies do not), from Linux's /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # After the command name (which may hold spaces), field 3 is the state, 5 the group.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended meanwhile
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            return True
    return False


def parse_with_serve_args(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    """A benchmark's own arguments (`parser`'s), and those after `--`, which go to every
    `tokenmill serve` it starts."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser.epilog = "Arguments after -- go to tokenmill serve."
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def stop_on_sigterm() -> None:
    """Make SIGTERM (e.g. from `timeout`) end this process through SystemExit, so that the
    `finally` blocks that stop its servers run (they are in sessions of their own)."""

    def exit_(signum: int, frame: object) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_)


@contextlib.contextmanager
def running_server(
    model_dir: str, serve_args: Sequence[str], log_path: Path,
    env: Mapping[str, str] | None = None, timeout_s: float = 600.0,
) -> Iterator[tuple[ServerProcess, StartTimes]]:  # fmt: skip
    """A started server that has answered its first completion, stopped on exit."""
    server = ServerProcess(model_dir, serve_args, log_path, env)
    server.start()
    try:
        yield server, server.wait_first_completion(timeout_s)
    finally:
        server.stop()
