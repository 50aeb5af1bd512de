"""The direct launch's key: equal keys must mean equal Triton specialisations (CPU; the
launches themselves are checked on the GPU in `tests/gpu/test_launch_gpu.py`)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from tokenmill.kernels.launch import _key_function, _Unkeyed


def _runtime(x, n=7, *, unused=None):  # a kernel's signature: parsed, never compiled
    pass


def _constexpr(x: tl.constexpr):
    pass


RUNTIME_KEY = _key_function(JITFunction(_runtime))
CONSTEXPR_KEY = _key_function(JITFunction(_constexpr))


def _ours(arg) -> object:
    return RUNTIME_KEY(arg)[0][1]


def _triton(arg) -> tuple:
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def _tensors() -> list[torch.Tensor]:
    base = {dt: torch.zeros(64, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int32)}
    return [t[offset:] for t in base.values() for offset in (0, 1, 2, 4, 8)]


INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
        -(2**31), -(2**31) - 1, -(2**31) - 16, 2**63 - 1, 2**63 - 16, 2**63,
        2**63 + 16]  # fmt: skip
VALUES = [*INTS, 0.0, 1.0, 1e-6, True, False, None, *_tensors(),
          torch.nn.Parameter(torch.zeros(8), requires_grad=False)]  # fmt: skip


def test_equal_keys_mean_equal_triton_specialisations() -> None:
    """Over edge values of every modelled type: any two arguments with one key are specialised
    alike by Triton (the key may split finer, never coarser)."""
    for a, b in itertools.combinations(VALUES, 2):
        if _ours(a) == _ours(b):
            assert _triton(a) == _triton(b), (a, b)


@given(st.integers(min_value=-(2**63), max_value=2**64 - 1), st.integers(-(2**63), 2**64 - 1))
def test_equal_int_keys_mean_equal_triton_specialisations(a: int, b: int) -> None:
    if _ours(a) == _ours(b):
        assert _triton(a) == _triton(b)


def test_int_keys_split_what_triton_splits() -> None:
    """1, multiples of 16 and the three widths are told apart (the key is not trivially fine)."""
    assert len({_ours(v) for v in (1, 16, 17, 2**31, 2**31 + 1, 2**63)}) == 6
    assert _ours(32) == _ours(48) and _ours(3) == _ours(5)


def test_key_holds_options_defaults_and_constexpr_types() -> None:
    """Launch options are part of the key; omitted arguments take their defaults; a constexpr's
    value is keyed with its type (`True` is not `1`)."""
    t = torch.zeros(4)
    (options, *_), full = RUNTIME_KEY(t, num_warps=4)
    assert options == (("num_warps", 4),) and full == (t, 7, None)
    assert RUNTIME_KEY(t)[0] != RUNTIME_KEY(t, num_warps=8)[0]
    assert CONSTEXPR_KEY(True)[0] != CONSTEXPR_KEY(1)[0]
    assert CONSTEXPR_KEY(64)[0] != CONSTEXPR_KEY(128)[0]


@pytest.mark.parametrize("arg", [(1, 2), "s", torch.int32, object()])
def test_unmodelled_arguments_take_tritons_path(arg) -> None:
    with pytest.raises(_Unkeyed):
        RUNTIME_KEY(arg)


def test_direct_path_only_for_checked_triton_versions_and_compiled_kernels(monkeypatch) -> None:
    """A Triton whose launcher protocol was not checked, and Triton's interpreter (this test
    session's kernels), take Triton's own launch."""
    from tokenmill.kernels import launch
    from tokenmill.kernels.norm import _add_rms_norm_kernel

    assert launch.DirectLaunch(JITFunction(_runtime))._direct == (
        ".".join(triton.__version__.split(".")[:2]) in launch.DIRECT_TRITON
    )
    monkeypatch.setattr(launch, "DIRECT_TRITON", ())
    assert not launch.DirectLaunch(JITFunction(_runtime))._direct
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    assert _add_rms_norm_kernel._direct is not interpreted
