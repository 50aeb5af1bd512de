"""The CPU engine's bounds on native memory (`tokenmill.runner.host_heap`)."""

from __future__ import annotations

import os

import pytest

from tokenmill.runner import host_heap
from tokenmill.runner.host_heap import ONEDNN_CACHE_CAPACITY, HeapTrimmer, bound_onednn_cache


def test_onednn_cache_capped_unless_the_environment_says(monkeypatch) -> None:
    env: dict[str, str] = {}  # the process's own environment stays as it is
    monkeypatch.setattr(os, "environ", env)
    bound_onednn_cache()
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_CACHE_CAPACITY)}
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "64"
    bound_onednn_cache()
    assert env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def test_trimmer_trims_at_most_once_per_interval(monkeypatch) -> None:
    calls: list[int] = []
    clock = [100.0]
    monkeypatch.setattr(host_heap, "_malloc_trim", lambda: lambda pad: calls.append(pad) or 1)
    trim = HeapTrimmer(interval_s=1.0, clock=lambda: clock[0])
    trim()
    trim()
    clock[0] += 0.5
    trim()
    assert calls == [0]
    clock[0] += 0.6
    trim()
    assert calls == [0, 0] and trim.trims == 2


def test_trimmer_is_a_no_op_without_malloc_trim(monkeypatch) -> None:
    monkeypatch.setattr(host_heap, "_malloc_trim", lambda: None)
    trim = HeapTrimmer()
    trim()
    assert trim.trims == 0


@pytest.mark.skipif(host_heap._malloc_trim() is None, reason="no glibc malloc_trim")
def test_trimmer_calls_the_c_library() -> None:
    trim = HeapTrimmer(interval_s=0.0)
    trim()
    trim()
    assert trim.trims == 2
