"""Reading a rank's share of a checkpoint tensor, and the vocabulary-parallel embedding.

Tensor parallelism shards a weight along one dimension (`tp_dim`, set on the parameter by the
layer that owns it: 0 for a column-parallel projection or the vocabulary, 1 for a row-parallel
one). The loader hands weights over as `TensorSource`s, so a rank reads only its slice of a
safetensors file (`safe_open(...).get_slice`), never the whole tensor.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.distributed.group import TPGroup
from tokenmill.layers.invariant import invariant_linear


class TensorSource(Protocol):
    """A checkpoint tensor that can be read whole or in part."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Its entries `[start, stop)` along `dim` (all of them by default)."""
        ...


class MemoryTensor:
    """A `TensorSource` over a tensor already in memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.tensor.narrow(dim, start, (self.shape[dim] if stop is None else stop) - start)


class SourceRange:
    """Entries `[start, stop)` along `dim` of another `TensorSource` (e.g. the gate half of a
    stacked gate/up tensor), itself a `TensorSource`."""

    def __init__(self, source: TensorSource, dim: int, start: int, stop: int) -> None:
        self.source, self.dim, self.start, self.stop = source, dim, start, stop

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.source.shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.shape[dim] if stop is None else stop
        if dim == self.dim:
            return self.source.read(dim, self.start + start, self.start + stop)
        return self.source.read(self.dim, self.start, self.stop).narrow(dim, start, stop - start)


class TransposedSource:
    """A 3-D `TensorSource` with its last two dimensions swapped (read as it is, then
    transposed: only the entries asked for are read)."""

    def __init__(self, source: TensorSource) -> None:
        self.source = source

    @property
    def shape(self) -> tuple[int, ...]:
        e, a, b = self.source.shape
        return (e, b, a)

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.shape[dim] if stop is None else stop
        theirs = {0: 0, 1: 2, 2: 1}[dim]
        return self.source.read(theirs, start, stop).transpose(1, 2)


def set_tp_dim(param: nn.Parameter, dim: int | None) -> nn.Parameter:
    """Mark the dimension tensor parallelism splits `param` along (None: every rank has all)."""
    param.tp_dim = dim  # type: ignore[attr-defined]
    return param


def tp_dim(param: nn.Parameter) -> int | None:
    """The dimension `param` is split along (`set_tp_dim`), or None."""
    return getattr(param, "tp_dim", None)


def copy_shard(
    target: torch.Tensor,
    source: TensorSource,
    dim: int,
    tp: TPGroup,
    what: str,
    start: int | None = None,
) -> None:
    """Copy rank `tp.rank`'s share of `source` along `dim` into `target`: entries `[start,
    start + target.shape[dim])`, by default the rank's share of an even split (`tp.split`: any
    other size is an error naming `what`); entries past the end of `source` (a padded
    vocabulary) are zeros."""
    full, size = source.shape[dim], target.shape[dim]
    others = [n for d, n in enumerate(source.shape) if d != dim]
    share = tp.split(full)
    fits = start is not None or share.size == size
    if (
        len(source.shape) != target.dim()
        or not fits
        or others != [n for d, n in enumerate(target.shape) if d != dim]
    ):
        expected = list(target.shape)
        expected[dim] *= tp.size
        raise ValueError(f"{what} has shape {source.shape}, expected {tuple(expected)}")
    start = share.start if start is None else start
    stop = min(start + size, full)
    target.narrow(dim, 0, stop - start).copy_(source.read(dim, start, stop))
    if stop - start < size:
        target.narrow(dim, stop - start, size - (stop - start)).zero_()


class VocabParallelEmbedding(nn.Module):
    """Token embeddings split by vocabulary rows across the ranks (`ceil(V / tp)` rows each,
    the last padded), also the LM head's weight: `logits` gathers every rank's share."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.shard = tp, tp.split(vocab_size)
        weight = nn.Parameter(torch.empty(self.shard.size, hidden_size), requires_grad=False)
        self.weight = set_tp_dim(weight, 0)
        self.batch_invariant = False  # `logits` through `invariant_linear`

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings `[T, hidden]` of token ids `[T]`."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.size)
        out = F.embedding(local.clamp(0, self.shard.size - 1), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits `[S, V]` of hidden states `[S, hidden]` (every rank gets them all)."""
        if self.batch_invariant:
            local = invariant_linear(hidden, self.weight)
        else:
            local = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return local
        return self.tp.all_gather(local)[..., : self.shard.full]
