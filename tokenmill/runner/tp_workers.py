"""Tensor-parallel ranks 1..N-1: one process each, running rank 0's plans on their shard.

Rank 0 is the engine core's own `ModelRunner`; it starts the others (`TPWorkers.start`), and
every step sends them the `StepPlan` it is about to launch, before launching it itself. A plan
holds only numpy arrays, ints and `SamplingParams`, so it travels pickled over one ZeroMQ PUSH
socket per worker (local, trusted: both ends are this engine); each rank lays it out and runs
the same forward pass, meeting the others in the collectives (all-reduces inside the model,
the gathered logits). Only rank 0 samples: the others receive its tokens (a broadcast), so the
next plan's `input_src` reads the same tokens on every rank. No rank waits for another on the
host: a worker runs plans as they come.

A worker that exits takes the engine with it: the watchdog thread sees its process end and
calls `on_lost` (the engine-core process exits, which the server reports); a collective
pending at that moment fails at once on gloo, after `COLLECTIVE_TIMEOUT` on NCCL. Workers exit
when rank 0's process does (`ipc.process.init_child`).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import zmq

from tokenmill.batch import StepPlan
from tokenmill.config import EngineConfig
from tokenmill.distributed.group import NCCL_ENV, TPGroup
from tokenmill.ipc.process import init_child

logger = logging.getLogger(__name__)

_STOP = b""  # the message that ends a worker
JOIN_TIMEOUT_S = 10.0
LOST_GRACE_S = 1.0


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank `rank`'s device: `cuda:(first + rank)` for an engine on `cuda[:first]`, else the
    engine's device (the CPU)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def share_cpu_threads(size: int) -> int:
    """On the CPU, give this rank 1/`size` of the cores this process may run on (every rank
    spinning on all of them makes each collective wait for a descheduled peer; measured 25x
    slower steps on 2 cores). Returns the threads set."""
    threads = max(1, len(os.sched_getaffinity(0)) // size)
    torch.set_num_threads(threads)
    return threads


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: their processes, plan sockets and watchdog."""

    def __init__(self, config: EngineConfig, log_level: str) -> None:
        size = config.parallel.tensor_parallel_size
        self.store = TPGroup.store(0, size)
        self.on_lost: Callable[[str], None] | None = None
        self.lost: str | None = None
        self._closing = threading.Event()  # set by `_stop_workers`: exits are expected
        os.environ.update(NCCL_ENV)  # this process's NCCL and, inherited, the workers'
        # A fresh interpreter per rank (not multiprocessing's spawn, which would run the
        # user's script again; not fork, unsafe once CUDA or threads run): its arguments come
        # pickled on stdin.
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(1, size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.runner.tp_workers"], stdin=subprocess.PIPE
            )
            assert proc.stdin is not None
            args = (config, rank, self.store.port, log_level, os.getpid())
            proc.stdin.write(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
            proc.stdin.close()
            self.procs.append(proc)
            logger.info("started tp_worker_%d (pid %d)", rank, proc.pid)
            # A weak reference: the watchdog must not keep an unused engine's workers alive.
            watch = (weakref.WeakMethod(self._watch), rank, proc)
            threading.Thread(target=_watchdog, args=watch, daemon=True).start()
        self._ctx = zmq.Context()
        self._plans: list[zmq.Socket] = []
        # At exit, or once the engine is garbage (an `LLM` deleted without `close`).
        self._stop = weakref.finalize(
            self, _stop_workers, self._closing, self._plans, self.procs, self._ctx
        )

    def connect(self) -> None:
        """Connect to each worker's plan socket (its address comes through the store)."""
        for rank in range(1, len(self.procs) + 1):
            key = f"plans/{rank}"
            while not self._ready(key):
                if self.lost is not None:
                    raise RuntimeError(self.lost)
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(self.store.get(key).decode())
            self._plans.append(sock)

    def _ready(self, key: str) -> bool:
        """Whether a worker has published `key`, after waiting up to half a second."""
        try:
            self.store.wait([key], datetime.timedelta(seconds=0.5))
        except dist.DistStoreError:
            return False
        return True

    def send(self, plan: StepPlan) -> None:
        """Hand `plan` to every worker (before rank 0 launches it)."""
        if self.lost is not None:
            raise RuntimeError(self.lost)
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._plans:
            sock.send(payload, copy=False)

    def failure(self, error: Exception) -> RuntimeError:
        """The error to raise for a collective that failed with `error`: the lost worker's
        (the watchdog gets a second to see it), else `error`'s."""
        deadline = time.monotonic() + LOST_GRACE_S
        while self.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return RuntimeError(self.lost or f"tensor-parallel collective failed: {error}")

    def close(self) -> None:
        """Stop the workers (each finishes the plan it runs), then kill any that lingers."""
        self._stop()  # once

    def _watch(self, rank: int, proc: subprocess.Popen[bytes], code: int) -> None:
        """Report worker `rank`, which exited with `code`, if the engine runs."""
        if self._closing.is_set() or self.lost is not None:
            return
        self.lost = (
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}; "
            "the engine cannot run without it"
        )
        logger.error("%s", self.lost)
        if self.on_lost is not None:
            self.on_lost(self.lost)


def _watchdog(watch: weakref.WeakMethod, rank: int, proc: subprocess.Popen[bytes]) -> None:
    """Wait for worker `rank` to exit, then report it (unless its `TPWorkers` is gone)."""
    code = proc.wait()
    report = watch()
    if report is not None:
        report(rank, proc, code)


def _stop_workers(
    closing: threading.Event,
    plans: list[zmq.Socket],
    procs: list[subprocess.Popen[bytes]],
    ctx: zmq.Context,
) -> None:
    """Stop the workers (each finishes the plan it runs), then kill any that lingers."""
    closing.set()
    for sock in plans:
        sock.send(_STOP)
    for proc in procs:
        try:
            proc.wait(JOIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    ctx.destroy(linger=0)


def run_tp_worker(
    config: EngineConfig, rank: int, port: int, log_level: str, engine_pid: int
) -> None:
    """Process entry point of rank `rank`: load its shard, then run plans until told to stop."""
    multiprocessing.current_process().name = f"tp_worker_{rank}"  # in every log line
    init_child(log_level, f"tp_worker_{rank}", engine_pid)
    from tokenmill.runner.model_runner import ModelRunner  # model_runner imports this module

    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    size = config.parallel.tensor_parallel_size
    store = TPGroup.store(rank, size, port)
    ctx = zmq.Context()
    plans = ctx.socket(zmq.PULL)
    plans.setsockopt(zmq.LINGER, 0)
    port = plans.bind_to_random_port("tcp://127.0.0.1")
    store.set(f"plans/{rank}", f"tcp://127.0.0.1:{port}")
    runner = ModelRunner(config, TPGroup.join(rank, size, store, device))
    while (payload := plans.recv()) != _STOP:
        runner.launch(pickle.loads(payload))
    ctx.destroy(linger=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    run_tp_worker(*pickle.load(sys.stdin.buffer))
