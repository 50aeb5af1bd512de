"""The engine core, started by `tokenmill serve` before the api server's imports.

The engine core's start-up (its imports, loading the weights, allocating the KV cache,
capturing CUDA graphs) is the longest part of a server's; the api server's own (torch,
transformers, FastAPI, the tokenizer) used to run first, 11 s on the H200 before the engine core
was even spawned. Started from the parsed arguments, before anything heavy is imported here
(this module imports no torch), the two run side by side. The engine core resolves the
arguments into its configuration itself; the api server resolves them too, meanwhile, for its
own use. The supervisor adopts the process (`Supervisor(started=...)`): it is watched, stopped
and restarted like one it spawned.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from tokenmill.config import EngineArgs, EngineConfig
from tokenmill.ipc.sockets import Addresses

logger = logging.getLogger("tokenmill.server")

ENGINE_PROCESS_NAME = "engine-core"
_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EarlyEngine:
    """An engine-core process started ahead of the api server, and the socket addresses of
    the server's processes it was given."""

    process: BaseProcess
    addresses: Addresses

    def stop(self) -> None:
        """End the process if it still runs (the server failed before adopting it, or did not
        stop it) and remove the sockets' folder."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.addresses.remove()


def start_engine_core(engine: EngineArgs, num_tokenizers: int, log_level: str) -> EarlyEngine:
    """Spawn the engine core for `engine`, with fresh addresses for the server's processes
    (`num_tokenizers` tokenizer workers). Returns at once."""
    addresses = Addresses.fresh(num_tokenizers)
    # Spawned, as the supervisor spawns it: CUDA starts in a process that never forked.
    context = multiprocessing.get_context("spawn")
    args = (engine, addresses, log_level, os.getpid())
    process = context.Process(
        target=engine_core_main, args=args, name=ENGINE_PROCESS_NAME, daemon=True
    )
    process.start()
    logger.info("started %s (pid %d) ahead of the server", ENGINE_PROCESS_NAME, process.pid)
    return EarlyEngine(process, addresses)


def engine_core_main(
    engine: EngineArgs | EngineConfig, addresses: Addresses, log_level: str, server_pid: int
) -> None:
    """The engine-core process's entry point (`core_process.run_engine_core`). A function of
    this light module, so that a server pickles a reference to it without importing the engine
    (torch, triton, the kernels) itself."""
    from tokenmill.engine.core_process import run_engine_core

    run_engine_core(engine, addresses, log_level, server_pid)
