"""Supervisor: starts the server's worker processes and keeps them running.

- A dead tokenizer worker is restarted at once; the requests it held (not yet accepted by the
  engine core) get a 503 error. Requests sent to it meanwhile wait in its socket for the new one.
- A dead detokenizer is restarted at once; every request in flight gets a 503 error (their
  incremental text state died with it).
- A dead engine core ends the server with exit code 1 and a log line saying why, so that an
  orchestrator restarts it; with `restart_engine` it is restarted in place instead, every request
  in flight gets an error and new ones get 503 until the model is loaded again.
- A worker that dies before the engine is ready (or an engine that dies while reloading) is a
  start-up failure: the server exits (it listens meanwhile, answering 503 on /v1 routes).
- A dead fork server (the tokenizer and detokenizer workers' parent) leaves its workers running,
  orphaned, though multiprocessing reports them dead: each is killed (through a pidfd, never a
  stale pid) and started again from a new fork server, like a dead worker, so that exactly the
  configured workers run and none is left over. A restart that fails (its fork server died
  meanwhile) is tried again; only a worker that cannot be restarted at all ends the server.
- Once the server is shutting down (`stopping`), a worker that dies is not restarted and is no
  error: a group-wide SIGTERM (systemd, `kill -- -PGID`) reaches the workers too. The requests it
  held get a 503 error; the server exits normally.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from tokenmill.config import EngineArgs, ServedModel
from tokenmill.entrypoints.early_start import (
    DETOKENIZER_PROCESS_NAME,
    ENGINE_PROCESS_NAME,
    detokenizer_main,
    engine_core_main,
    tokenizer_name,
)
from tokenmill.entrypoints.engine_client import EngineClient
from tokenmill.entrypoints.fork_server import start_fork_server
from tokenmill.ipc.pidfd import ProcessRef
from tokenmill.ipc.sockets import Addresses
from tokenmill.tokenization.tokenizer_worker import run_tokenizer_worker
from tokenmill.vision.images import image_setup

logger = logging.getLogger("tokenmill.server")

CHECK_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 5.0
# A restart that fails is tried again (each try starts a new fork server if the last one died),
# after a pause: multiprocessing starts a new one only once the dead one has exited (waitpid).
RESTART_ATTEMPTS = 3
RESTART_PAUSE_S = 0.5


class WorkerKind(enum.Enum):
    """What a worker does, which decides what its death means."""

    ENGINE = "engine"
    DETOKENIZER = "detokenizer"
    TOKENIZER = "tokenizer"


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker process (again)."""

    name: str  # "engine-core", "detokenizer", "tokenizer-0", ...
    kind: WorkerKind
    target: Callable[..., None]
    args: tuple[Any, ...]
    index: int = 0  # the tokenizer worker's number


def server_workers(
    engine: EngineArgs,
    served: ServedModel,
    addresses: Addresses,
    tokenizer_path: str,
    log_level: str,
    chat_template: str | None = None,
) -> list[WorkerSpec]:
    """The engine core, the detokenizer and one tokenizer worker per tokenizer address (with
    `chat_template` instead of the tokenizer's own, if given)."""
    limits = served.context_limits
    server = os.getpid()
    specs = [
        WorkerSpec(
            ENGINE_PROCESS_NAME,
            WorkerKind.ENGINE,
            engine_core_main,
            (engine, addresses, log_level, server),
        ),
        WorkerSpec(
            DETOKENIZER_PROCESS_NAME,
            WorkerKind.DETOKENIZER,
            detokenizer_main,
            (tokenizer_path, addresses, log_level, server),
        ),
    ]
    images = image_setup(served)
    for i in range(len(addresses.tokenizers)):
        args = (i, tokenizer_path, limits, addresses, log_level, server, chat_template, images)
        specs.append(
            WorkerSpec(tokenizer_name(i), WorkerKind.TOKENIZER, run_tokenizer_worker, args, i)
        )
    return specs


class Supervisor:
    """Starts the workers and watches them (`run`, a task of the api server), and stops them.

    `on_fatal(message)` is called once when the server must end (exit code 1).
    """

    def __init__(
        self,
        specs: list[WorkerSpec],
        client: EngineClient,
        restart_engine: bool,
        on_fatal: Callable[[str], None],
        started: Callable[[], Mapping[str, BaseProcess]] | None = None,
    ) -> None:
        """`started` gives the workers started already, by name (`early_start`), which `start`
        adopts instead of starting them (it may wait for them to be started)."""
        self.specs = specs
        self._started = started
        self.client = client
        self.restart_engine = restart_engine
        self.on_fatal = on_fatal
        self.procs: dict[str, BaseProcess] = {}
        # Each process's pidfd: whether it runs, told apart from what its fork server reports.
        self._refs: dict[str, ProcessRef] = {}
        self.restarts = 0
        self.failed = False
        self.stopping = False  # the server is shutting down: deaths are expected
        # `start` runs in a thread of its own (`run`): `stop` waits for it to finish.
        self._starting = threading.Lock()
        # Tokenizer and detokenizer workers fork from a server process that imported their
        # modules once, so a restart takes a fraction of a second, not the seconds of importing
        # transformers again. `tokenmill serve` started that fork server before its own imports
        # (`fork_server`); where nothing did, it starts here, with the model-specific modules
        # this process loaded with the tokenizer imported there too (loading a tokenizer
        # imports its model's configuration). The engine core is spawned, so that CUDA starts
        # in a process that never forked.
        self._forked = multiprocessing.get_context("forkserver")
        self._spawned = multiprocessing.get_context("spawn")
        modules = {spec.target.__module__ for spec in specs if spec.kind is not WorkerKind.ENGINE}
        # A copy: the server's tokenizer may be importing on another thread meanwhile.
        loaded = list(sys.modules)
        modules |= {name for name in loaded if name.startswith("transformers.models.")}
        start_fork_server(modules)

    async def run(self) -> None:
        """Start every worker, then watch them forever. The workers start in a thread: the
        fork server's first start imports the tokenizers' modules, seconds during which the
        api server answers requests (503 until the engine is ready)."""
        try:
            await asyncio.to_thread(self.start)
        except Exception as exc:  # e.g. the system refuses a new process
            self.fail(f"cannot start the server's processes: {exc!r}")
            return
        await self.watch()

    def start(self) -> None:
        """Start every worker not running already, the engine core first (it takes the longest
        to be ready)."""
        with self._starting:
            if self._started is not None:
                for name, proc in self._started().items():
                    self._track(name, proc)
            for spec in self.specs:
                if self.failed or self.stopping:  # stopping already: start no more
                    return
                if spec.name not in self.procs:
                    self._spawn(spec)

    def _spawn(self, spec: WorkerSpec) -> BaseProcess:
        ctx = self._spawned if spec.kind is WorkerKind.ENGINE else self._forked
        proc = ctx.Process(target=spec.target, args=spec.args, name=spec.name, daemon=True)
        proc.start()
        logger.info("started %s (pid %d)", spec.name, proc.pid)
        self._track(spec.name, proc)
        return proc

    def _track(self, name: str, proc: BaseProcess) -> None:
        assert proc.pid is not None
        self.procs[name] = proc
        ref = ProcessRef.open(proc.pid)
        if ref is not None:
            self._refs[name] = ref

    async def watch(self) -> None:
        """Forever: restart or report dead workers."""
        while not self.failed:
            self.check()
            await asyncio.sleep(CHECK_INTERVAL_S)

    def check(self) -> None:
        """Handle every worker that died since the last check."""
        for spec in self.specs:
            # None: not started (stopping during start-up), or died while stopping (reaped)
            proc = self.procs.get(spec.name)
            if self.failed or proc is None or proc.is_alive():
                continue
            proc.join()  # reap it
            what = self._ended(spec.name, proc)
            if self.stopping:
                self._died_stopping(spec, what)
            elif not self.client.ready.is_set():
                self.fail(f"server process died before the server was ready: {what}")
            elif spec.kind is WorkerKind.ENGINE:
                self._engine_died(spec, what)
            else:
                self._worker_died(spec, what)

    def _ended(self, name: str, proc: BaseProcess) -> str:
        """What ended `proc`, reported dead; an orphan of a dead fork server is killed first."""
        ref = self._refs.pop(name, None)
        if ref is None or not ref.running():
            if ref is not None:
                ref.close()
            return f"{name} (pid {proc.pid}) died with exit code {proc.exitcode}"
        killed = ref.kill(STOP_TIMEOUT_S)
        ref.close()
        how = "killed it" if killed else f"it did not end within {STOP_TIMEOUT_S:.0f} s of SIGKILL"
        return f"{name} (pid {proc.pid}) lost its fork server ({how})"

    def _restart(self, spec: WorkerSpec, what: str) -> BaseProcess | None:
        """Start `spec` again, trying `RESTART_ATTEMPTS` times (a fork server that dies during a
        start fails it; the next start starts a new one); None, and the server ends, if no try
        succeeds."""
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            try:
                proc = self._spawn(spec)
            except (OSError, EOFError) as exc:  # EOFError: the fork server died while forking
                logger.warning("%s: restart %d failed: %r", spec.name, attempt, exc)
                time.sleep(RESTART_PAUSE_S)
                continue
            self.restarts += 1
            return proc
        self.fail(f"{what}; it could not be restarted ({RESTART_ATTEMPTS} tries failed)")
        return None

    def _engine_died(self, spec: WorkerSpec, what: str) -> None:
        if self.client.awaiting_engine:
            self.fail(f"server process died while restarting: {what}")
            return
        if not self.restart_engine:
            logger.error("%s; exiting (--restart-engine restarts it in place instead)", what)
            self.fail(f"server process died: {what}")
            return
        num_failed = self.client.num_in_flight
        proc = self._restart(spec, what)
        if proc is None:
            return
        logger.error(
            "%s; restarted it (--restart-engine), failing %d requests in flight", what, num_failed
        )
        self.client.engine_restarting(f"{what}; it is restarting, retry shortly", proc.pid)

    def _worker_died(self, spec: WorkerSpec, what: str) -> None:
        message = f"{what} while this request was in flight; retry"
        tokenizer = spec.index if spec.kind is WorkerKind.TOKENIZER else None
        num_failed = self.client.fail_in_flight(message, status=503, tokenizer=tokenizer)
        if self._restart(spec, what) is None:
            return
        logger.error("%s; restarted it, failing %d requests it held", what, num_failed)

    def _died_stopping(self, spec: WorkerSpec, what: str) -> None:
        message = f"the server is shutting down ({what})"
        tokenizer = spec.index if spec.kind is WorkerKind.TOKENIZER else None
        self.client.fail_in_flight(message, status=503, tokenizer=tokenizer)
        del self.procs[spec.name]  # reaped, and not restarted: nothing left to check or stop
        logger.info("%s while the server is shutting down", what)

    def fail(self, message: str) -> None:
        """End the server (exit code 1): log why, fail every request, refuse new ones."""
        self.failed = True
        logger.error(message)
        self.client.fail_all(message)
        self.client.ready.set()  # unblock start-up so that it can report the failure
        self.on_fatal(message)

    def stop(self) -> None:
        """Let the engine core abort its requests and exit, then stop the other workers (once
        `start`, if it is running, has returned)."""
        self.failed = True  # deaths from here on are expected
        with self._starting:
            self.client.shutdown_engine()
            engine = self.procs.get(ENGINE_PROCESS_NAME)
            if engine is not None:
                engine.join(timeout=STOP_TIMEOUT_S)
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.terminate()
            for proc in self.procs.values():
                proc.join(timeout=STOP_TIMEOUT_S)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            self._kill_orphans()

    def _kill_orphans(self) -> None:
        """Kill the workers a dead fork server left running (multiprocessing reports them ended,
        so `stop` did not), and close every pidfd."""
        for name, ref in self._refs.items():
            if ref.running():
                logger.info("killing %s: its fork server died", name)
                ref.kill(STOP_TIMEOUT_S)
            ref.close()
        self._refs.clear()
