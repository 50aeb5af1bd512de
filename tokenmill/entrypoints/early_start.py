"""The engine core, the fork server and the detokenizer, started by `tokenmill serve` before the
api server's imports.

The engine core's start-up (its imports, loading the weights, allocating the KV cache,
capturing CUDA graphs) is the longest part of a server's; the api server's own (torch,
transformers, FastAPI, the tokenizer) used to run first, 11 s on the H200 before the engine core
was even spawned. Started from the parsed arguments, before anything heavy is imported here
(this module imports no torch), the two run side by side. The engine core resolves the
arguments into its configuration itself; the api server resolves them too, meanwhile, for its
own use. The detokenizer, which passes the engine core's first stats (its "ready") on to the
server, forks from the fork server as soon as that has imported its modules, instead of after
the server's imports and set-up. The supervisor adopts both processes (`Supervisor(started=...)`):
they are watched, stopped and restarted like the ones it starts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.entrypoints.fork_server import start_fork_server
from tokenmill.ipc.sockets import Addresses

logger = logging.getLogger("tokenmill.server")

ENGINE_PROCESS_NAME = "engine-core"
DETOKENIZER_PROCESS_NAME = "detokenizer"
_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EarlyStart:
    """The engine core and the detokenizer started ahead of the api server, and the socket
    addresses of the server's processes they were given. The detokenizer starts in
    `starter`, a thread: a fork server's first fork waits until it has imported its modules."""

    engine: BaseProcess
    detokenizer: BaseProcess
    starter: threading.Thread
    addresses: Addresses

    def processes(self) -> dict[str, BaseProcess]:
        """The processes by name, once the detokenizer's start has returned (it waits for the
        fork server); without the detokenizer if it could not start (the supervisor starts
        one then)."""
        self.starter.join()
        started = {ENGINE_PROCESS_NAME: self.engine, DETOKENIZER_PROCESS_NAME: self.detokenizer}
        return {name: process for name, process in started.items() if process.pid is not None}

    def stop(self) -> None:
        """End the processes that still run (the server failed before adopting them, or did
        not stop them) and remove the sockets' folder."""
        for process in self.processes().values():
            if process.is_alive():
                process.terminate()
                process.join(_STOP_TIMEOUT_S)
                if process.is_alive():
                    process.kill()
                    process.join()
        self.addresses.remove()


def start_early(engine: EngineArgs, num_tokenizers: int, log_level: str) -> EarlyStart:
    """Spawn the engine core for `engine`, start the fork server (`fork_server`) and, in a
    thread, the detokenizer from it, with fresh addresses for the server's processes
    (`num_tokenizers` tokenizer workers). Returns at once."""
    addresses = Addresses.fresh(num_tokenizers)
    server_pid = os.getpid()
    # Spawned, as the supervisor spawns it: CUDA starts in a process that never forked.
    process = multiprocessing.get_context("spawn").Process(
        target=engine_core_main, args=(engine, addresses, log_level, server_pid),
        name=ENGINE_PROCESS_NAME, daemon=True,
    )  # fmt: skip
    process.start()
    logger.info("started %s (pid %d) ahead of the server", ENGINE_PROCESS_NAME, process.pid)
    start_fork_server()
    tokenizer_path = engine.tokenizer or engine.model
    detokenizer = multiprocessing.get_context("forkserver").Process(
        target=detokenizer_main, args=(tokenizer_path, addresses, log_level, server_pid),
        name=DETOKENIZER_PROCESS_NAME, daemon=True,
    )  # fmt: skip
    starter = threading.Thread(target=_start_detokenizer, args=(detokenizer,), daemon=True)
    starter.start()
    return EarlyStart(process, detokenizer, starter, addresses)


def _start_detokenizer(process: BaseProcess) -> None:
    process.start()
    logger.info("started %s (pid %d) ahead of the server", process.name, process.pid)


def engine_core_main(
    engine: EngineArgs | EngineConfig, addresses: Addresses, log_level: str, server_pid: int
) -> None:
    """The engine-core process's entry point (`core_process.run_engine_core`). A function of
    this light module, so that a server pickles a reference to it without importing the engine
    (torch, triton, the kernels) itself."""
    from tokenmill.engine.core_process import run_engine_core

    run_engine_core(engine, addresses, log_level, server_pid)


def detokenizer_main(
    tokenizer_path: str, addresses: Addresses, log_level: str, server_pid: int
) -> None:
    """The detokenizer's entry point (`detokenizer_worker.run_detokenizer`), here for the same
    reason as `engine_core_main` (the fork server has imported its module already)."""
    from tokenmill.tokenization.detokenizer_worker import run_detokenizer

    run_detokenizer(tokenizer_path, addresses, log_level, server_pid)
