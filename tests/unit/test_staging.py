"""HostStaging: a step's int64 arrays uploaded as views of one block, each 16-byte aligned."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.runner.staging import HostStaging


def test_views_hold_the_arrays_each_from_a_16_byte_boundary() -> None:
    staging = HostStaging(torch.device("cpu"))
    arrays = [
        np.arange(3, dtype=np.int64),
        np.arange(10, dtype=np.int64).reshape(2, 5) * 2,
        np.zeros(0, dtype=np.int64),
        np.arange(7, dtype=np.int64) - 9,
        np.array([5], dtype=np.int64),
    ]
    views = staging.to_device(*arrays)
    base = views[0].data_ptr()
    for view, array in zip(views, arrays, strict=True):
        assert view.shape == array.shape
        assert view.numpy().tolist() == array.tolist()
        assert (view.data_ptr() - base) % 16 == 0


def test_upload_writes_the_array_at_the_start_of_dst() -> None:
    staging = HostStaging(torch.device("cpu"))
    dst = torch.full((6,), -1, dtype=torch.int64)
    staging.upload(np.arange(3, dtype=np.int64) + 4, dst)
    assert dst.tolist() == [4, 5, 6, -1, -1, -1]
