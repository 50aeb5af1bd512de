"""A rank's slice of each kind of checkpoint tensor, checked without any process group."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.distributed as dist

from tokenmill.distributed.group import TPGroup
from tokenmill.layers.linear import MergedLinear, QKVLinear
from tokenmill.layers.moe import FusedMoE
from tokenmill.layers.sharding import MemoryTensor, SourceRange, copy_shard


def _rank(rank: int, size: int) -> TPGroup:
    """A group member that never communicates (only its place is read here)."""
    return TPGroup(rank, size, cast(dist.ProcessGroup, object()) if size > 1 else None)


def test_an_even_split_and_a_padded_last_share() -> None:
    full = torch.arange(10.0).reshape(5, 2)
    shares = []
    for rank in range(2):
        target = torch.full((3, 2), -1.0)
        copy_shard(target, MemoryTensor(full), 0, _rank(rank, 2), "w")
        shares.append(target)
    assert shares[0].tolist() == full[:3].tolist()
    assert shares[1].tolist() == [*full[3:].tolist(), [0.0, 0.0]]  # row 5 is padding


def test_a_share_of_the_wrong_size_or_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"w has shape \(6, 2\), expected \(4, 2\)"):
        copy_shard(torch.empty(2, 2), MemoryTensor(torch.zeros(6, 2)), 0, _rank(0, 2), "w")
    with pytest.raises(ValueError, match="expected"):
        copy_shard(torch.empty(2, 2), MemoryTensor(torch.zeros(4, 3)), 0, _rank(0, 2), "w")


@pytest.mark.parametrize(
    ("kv_heads", "size", "expected"),
    [
        (2, 2, [[0], [1]]),
        (2, 4, [[0], [0], [1], [1]]),
        (1, 2, [[0], [0]]),
        (4, 2, [[0, 1], [2, 3]]),
    ],
)
def test_key_value_heads_are_split_or_shared(
    kv_heads: int, size: int, expected: list[list[int]]
) -> None:
    head_dim = 2
    k = torch.arange(kv_heads).repeat_interleave(head_dim)[:, None].float().expand(-1, 3)
    for rank in range(size):
        layer = QKVLinear(3, head_dim, 1, max(1, kv_heads // size), False, _rank(rank, size))
        layer.weight_loader(layer.weight, MemoryTensor(torch.zeros(size * head_dim, 3)), "q")
        layer.weight_loader(layer.weight, MemoryTensor(k.contiguous()), "k")
        offset, rows = layer.shard_offsets["k"]
        heads = layer.weight[offset : offset + rows, 0].reshape(-1, head_dim)[:, 0]
        assert heads.tolist() == expected[rank]


def test_gate_and_up_rows_of_each_rank() -> None:
    gate = torch.arange(8.0)[:, None].expand(-1, 2).contiguous()
    layer = MergedLinear(2, {"gate": 4, "up": 4}, tp=_rank(1, 2))
    layer.weight_loader(layer.weight, MemoryTensor(gate), "gate")
    assert layer.weight[:4, 0].tolist() == [4.0, 5.0, 6.0, 7.0]


def test_stacked_experts_are_cut_per_rank() -> None:
    experts, hidden, inter = 2, 3, 4
    gate_up = torch.arange(experts * 2 * inter * hidden, dtype=torch.float32)
    gate_up = gate_up.reshape(experts, 2 * inter, hidden)
    down = torch.arange(experts * hidden * inter, dtype=torch.float32)
    down = down.reshape(experts, hidden, inter)
    layer = FusedMoE(experts, hidden, inter // 2, 1, False, _rank(1, 2))
    layer.load_stacked(layer.gate_up_proj, MemoryTensor(gate_up))
    layer.load_stacked(layer.down_proj, MemoryTensor(down))
    assert torch.equal(layer.gate_up_proj[:, :2], gate_up[:, 2:4])  # gate rows 2, 3
    assert torch.equal(layer.gate_up_proj[:, 2:], gate_up[:, 6:8])  # up rows 2, 3
    assert torch.equal(layer.down_proj, down[:, :, 2:])


def test_a_source_range_reads_inside_its_range() -> None:
    full = MemoryTensor(torch.arange(24.0).reshape(2, 6, 2))
    second_half = SourceRange(full, 1, 3, 6)
    assert second_half.shape == (2, 3, 2)
    assert torch.equal(second_half.read(1, 1, 3), full.tensor[:, 4:6])
    assert torch.equal(second_half.read(2, 1, 2), full.tensor[:, 3:6, 1:2])
