"""The tensor-parallel group: which shard of the model this process holds, and its collectives.

A `TPGroup` of size 1 is the plain single-device model: every collective returns its input and
no process group exists. Larger groups talk through a torch.distributed backend made for this
group alone (gloo on the CPU, NCCL on CUDA) from a TCP store on the loopback interface, so an
engine never touches (or needs) the default process group of the program it runs in.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NCCL's NVLink multicast (NVLS) is left off: the GPU machines here do not support it reliably.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0"}
# How long a collective may wait for a peer before it fails (a peer that died fails at once on
# gloo; NCCL notices through this timeout).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class Shard:
    """The slice `[start, start + size)` of a dimension of `full` entries that one rank holds
    (it may reach past `full`: the last share of a split that does not divide)."""

    start: int
    size: int
    full: int


class TPGroup:
    """Rank `rank` of `size` processes, each holding 1/size of every sharded weight."""

    def __init__(self, rank: int, size: int, backend: dist.ProcessGroup | None = None) -> None:
        if size > 1 and backend is None:
            raise ValueError("a tensor-parallel group of several ranks needs a process group")
        self.rank, self.size, self._pg = rank, size, backend

    @staticmethod
    def single() -> TPGroup:
        """The group of one: no sharding, no communication."""
        return TPGroup(0, 1)

    @staticmethod
    def store(rank: int, size: int, port: int = 0) -> dist.TCPStore:
        """The group's key-value store on 127.0.0.1: rank 0 serves it (on a free port when
        `port` is 0: read `store.port`) without waiting for the others, who connect to it."""
        return dist.TCPStore(
            "127.0.0.1", port, size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )  # fmt: skip

    @staticmethod
    def join(rank: int, size: int, store: dist.Store, device: torch.device) -> TPGroup:
        """Rank `rank`'s membership of the group whose ranks meet at `store`; NCCL on CUDA
        devices, gloo otherwise. Returns once every rank has joined."""
        if device.type == "cuda":
            os.environ.update(NCCL_ENV)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            backend: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            backend = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        group = TPGroup(rank, size, backend)
        group.barrier(device)  # every rank is there (NCCL connects on its first collective)
        return group

    def split(self, full: int) -> Shard:
        """This rank's contiguous share of `full` entries: `ceil(full / size)` each, the last
        rank's padded past `full` (a vocabulary that does not divide)."""
        size = -(-full // self.size)
        return Shard(self.rank * size, size, full)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place; `x` itself for a group of one."""
        if self._pg is not None:
            self._pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, rank order."""
        if self._pg is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place."""
        if self._pg is not None:
            self._pg.broadcast(x, 0).wait()
        return x

    def min(self, value: int, device: torch.device) -> int:
        """The smallest `value` of any rank (e.g. the KV pages every rank has room for)."""
        if self._pg is None:
            return value
        x = torch.tensor([value], dtype=torch.int64, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._pg.allreduce([x], opts).wait()
        return int(x.item())

    def barrier(self, device: torch.device) -> None:
        """Wait until every rank got here."""
        if self._pg is not None:
            self.all_reduce(torch.zeros(1, device=device))
