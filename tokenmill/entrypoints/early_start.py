"""The engine core, the fork server and the detokenizer, started by `tokenmill serve` before the
api server's imports.

The engine core's start-up (its imports, loading the weights, allocating the KV cache,
capturing CUDA graphs) is the longest part of a server's; the api server's own (torch,
transformers, FastAPI, the tokenizer) used to run first, 11 s on the H200 before the engine core
was even spawned. Started from the parsed arguments, before anything heavy is imported here
(this module imports no torch), the two run side by side. The engine core resolves the
arguments into its configuration itself; the api server and the tokenizer workers resolve
the part they need (`EngineArgs.create_served_model`, without torch), meanwhile, for their own
use. The detokenizer, which passes the engine core's first stats (its "ready") on to the
server, forks from the fork server as soon as that has imported its modules, instead of after
the server's imports and set-up. The supervisor adopts both processes (`Supervisor(started=...)`):
they are watched, stopped and restarted like the ones it starts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
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
    """The engine core, the detokenizer and the tokenizer workers started ahead of the api
    server, and the socket addresses of the server's processes they were given. The workers
    (`forked`) start in `starter`, a thread: a fork server's first fork waits until it has
    imported its modules."""

    engine: BaseProcess
    forked: tuple[BaseProcess, ...]
    starter: threading.Thread
    addresses: Addresses

    def processes(self) -> dict[str, BaseProcess]:
        """The processes by name, once the workers' start has returned (it waits for the fork
        server); without a worker that could not start (the supervisor starts one then)."""
        if self.starter.ident is not None:  # None: never started (`start_early` interrupted)
            self.starter.join()
        started = (self.engine, *self.forked)
        return {process.name: process for process in started if process.pid is not None}

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


def start_early(
    engine: EngineArgs, num_tokenizers: int, chat_template: str | None, log_level: str
) -> EarlyStart:
    """Spawn the engine core for `engine`, start the fork server (`fork_server`) and, in a
    thread, the detokenizer and `num_tokenizers` tokenizer workers (with the server's
    `--chat-template`) from it, with fresh addresses for the server's processes. Returns at
    once; a signal meanwhile (KeyboardInterrupt, `stop_signals.Stopped`) stops what started."""
    addresses = Addresses.fresh(num_tokenizers)
    server_pid = os.getpid()
    # Spawned, as the supervisor spawns it: CUDA starts in a process that never forked.
    process = multiprocessing.get_context("spawn").Process(
        target=engine_core_main, args=(engine, addresses, log_level, server_pid),
        name=ENGINE_PROCESS_NAME, daemon=True,
    )  # fmt: skip
    forked = _forked_workers(engine, num_tokenizers, chat_template, addresses, log_level)
    starter = threading.Thread(target=_start_all, args=(forked,), daemon=True)
    early = EarlyStart(process, tuple(forked), starter, addresses)
    try:
        process.start()
        logger.info("started %s (pid %d) ahead of the server", ENGINE_PROCESS_NAME, process.pid)
        start_fork_server()
        starter.start()
    except BaseException:
        early.stop()
        raise
    return early


def _forked_workers(
    engine: EngineArgs,
    num_tokenizers: int,
    chat_template: str | None,
    addresses: Addresses,
    log_level: str,
) -> list[BaseProcess]:
    """The detokenizer and the tokenizer workers, to start from the fork server."""
    tokenizer_path = engine.tokenizer or engine.model
    forkserver = multiprocessing.get_context("forkserver")
    server_pid = os.getpid()
    forked = [
        forkserver.Process(
            target=detokenizer_main, args=(tokenizer_path, addresses, log_level, server_pid),
            name=DETOKENIZER_PROCESS_NAME, daemon=True,
        )
    ]  # fmt: skip
    for i in range(num_tokenizers):
        args = (i, engine, addresses, log_level, server_pid, chat_template)
        forked.append(
            forkserver.Process(
                target=tokenizer_main, args=args, name=tokenizer_name(i), daemon=True
            )
        )
    return forked


def tokenizer_name(index: int) -> str:
    """The process name of tokenizer worker `index`."""
    return f"tokenizer-{index}"


def _start_all(processes: list[BaseProcess]) -> None:
    for process in processes:
        try:
            process.start()
        except (OSError, EOFError) as exc:  # EOFError: the fork server died (a signal to all)
            logger.warning("could not start %s ahead of the server: %r", process.name, exc)
            continue  # the supervisor starts it, if the server goes on
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


def tokenizer_main(
    index: int,
    engine: EngineArgs,
    addresses: Addresses,
    log_level: str,
    server_pid: int,
    chat_template: str | None,
) -> None:
    """A tokenizer worker's entry point when started ahead of the server: it resolves the
    arguments into the context limits and the image set-up (`create_served_model`, without
    torch), and reads the chat template, itself (the server does the same meanwhile; an error
    there ends the worker quietly, and the server reports it)."""
    from tokenmill.tokenization.tokenizer import read_chat_template
    from tokenmill.tokenization.tokenizer_worker import run_tokenizer_worker
    from tokenmill.vision.images import image_setup

    try:
        served = engine.create_served_model()
        template = read_chat_template(chat_template)
    except ValueError:
        sys.exit(1)
    tokenizer_path = engine.tokenizer or engine.model
    run_tokenizer_worker(
        index, tokenizer_path, served.context_limits, addresses, log_level, server_pid, template,
        image_setup(served),
    )  # fmt: skip
