"""The direct launch (`kernels/launch.py`) on the CPU: equal keys must mean equal Triton cache
keys, and `launch` calls a cached kernel's launcher with Triton's arguments (faked compiled
kernels; the real launches are checked on the GPU in `tests/gpu/test_launch_gpu.py`)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from tokenmill.kernels import launch
from tokenmill.kernels.launch import DirectLaunch, _key_function, _Unkeyed


def _runtime(x, n=7, *, unused=None):  # kernels' signatures: parsed, never compiled
    pass


def _constexpr(x: tl.constexpr):
    pass


RUNTIME, CONSTEXPR = JITFunction(_runtime), JITFunction(_constexpr)
KEYS = {jit: _key_function(jit) for jit in (RUNTIME, CONSTEXPR)}
BINDERS = {jit: create_function_from_signature(jit.signature, jit.params, BaseBackend)
           for jit in (RUNTIME, CONSTEXPR)}  # fmt: skip


def _ours(jit: JITFunction, *args, **kwargs) -> object:
    return KEYS[jit](*args, **kwargs)[0]


def _triton(jit: JITFunction, *args, **kwargs) -> str:
    """Triton's cache key of a launch (as `JITFunction.run` computes it)."""
    _, specialization, options = BINDERS[jit](*args, **kwargs)
    return compute_cache_key({}, specialization, options)


def _refines(jit: JITFunction, calls: list[tuple[tuple, dict]]) -> None:
    """Any two of `calls` with one key of ours have one Triton key."""
    for (a, ka), (b, kb) in itertools.combinations(calls, 2):
        if _ours(jit, *a, **ka) == _ours(jit, *b, **kb):
            assert _triton(jit, *a, **ka) == _triton(jit, *b, **kb), (a, ka, b, kb)


def _tensors() -> list[torch.Tensor]:
    base = {dt: torch.zeros(64, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int32)}
    return [t[offset:] for t in base.values() for offset in (0, 1, 2, 4, 8)]


INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
        -(2**31), -(2**31) - 1, -(2**31) - 16, 2**63 - 1, 2**63 - 16, 2**63,
        2**63 + 16]  # fmt: skip
PARAMETERS = [torch.nn.Parameter(torch.zeros(9)[i:], requires_grad=False) for i in (0, 1)]
VALUES = [*INTS, 0.0, -0.0, 1.0, 1e-6, True, False, None, *_tensors(), *PARAMETERS]
CONSTEXPRS = [0, 1, 2, 16, True, False, None, 0.0, -0.0, 1.0, (1,), (True,), (1.0,), "a",
              tl.constexpr(0.0), tl.constexpr(-0.0), tl.bfloat16, tl.float16]  # fmt: skip
OPTIONS = [{}, {"num_warps": 4}, {"num_warps": 8}, {"num_warps": 4, "launch_pdl": True},
           {"num_warps": 4, "launch_pdl": 1}, {"launch_pdl": True, "num_warps": 4}]  # fmt: skip


def test_equal_keys_mean_equal_triton_keys() -> None:
    """Over edge values of every modelled type, as a runtime argument, as a constexpr and with
    launch options: two launches with one key have one Triton key (ours may split finer)."""
    _refines(RUNTIME, [((v,), {}) for v in VALUES])
    _refines(CONSTEXPR, [((v,), {}) for v in CONSTEXPRS])
    t = torch.zeros(4)
    _refines(RUNTIME, [((t, n), options) for n in (16, 17) for options in OPTIONS])


@given(st.integers(min_value=-(2**63), max_value=2**64 - 1), st.integers(-(2**63), 2**64 - 1))
def test_equal_int_keys_mean_equal_triton_keys(a: int, b: int) -> None:
    _refines(RUNTIME, [((a,), {}), ((b,), {})])


def test_keys_split_what_triton_splits() -> None:
    """1, multiples of 16 and the three widths, alignment, constexpr types and launch options
    are told apart (the key is not trivially fine)."""
    assert len({_ours(RUNTIME, v) for v in (1, 16, 17, 2**31, 2**31 + 1, 2**63)}) == 6
    assert _ours(RUNTIME, 32) == _ours(RUNTIME, 48) and _ours(RUNTIME, 3) == _ours(RUNTIME, 5)
    assert _ours(RUNTIME, PARAMETERS[0]) != _ours(RUNTIME, PARAMETERS[1])
    assert _ours(CONSTEXPR, True) != _ours(CONSTEXPR, 1)
    assert _ours(CONSTEXPR, 0.0) != _ours(CONSTEXPR, -0.0)
    t = torch.zeros(4)
    assert _ours(RUNTIME, t) != _ours(RUNTIME, t, num_warps=8)
    assert _ours(RUNTIME, t, launch_pdl=True) != _ours(RUNTIME, t, launch_pdl=1)


def test_key_function_returns_every_argument_in_order() -> None:
    t = torch.zeros(4)
    assert KEYS[RUNTIME](t, num_warps=4)[1] == (t, 7, None)
    assert KEYS[RUNTIME](t, unused=3, n=2)[1] == (t, 2, 3)


@pytest.mark.parametrize("arg", [(1, 2), "s", torch.int32, object()])
def test_unmodelled_arguments_take_tritons_path(arg) -> None:
    with pytest.raises(_Unkeyed):
        KEYS[RUNTIME](arg)


class _Compiled:
    """A compiled kernel's stand-in: its launcher records each call."""

    def __init__(self, calls: list) -> None:
        self.function, self.packed_metadata = "function", "metadata"
        self.run = lambda *args: calls.append(args)


class _Jit:
    """`JITFunction`'s stand-in: `jit[grid](...)` records Triton's launch and returns a
    compiled kernel."""

    def __init__(self) -> None:
        self.pre_run_hooks: list = []
        self.triton_launches: list = []
        self.direct_launches: list = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.triton_launches.append((grid, args, kwargs))
            return _Compiled(self.direct_launches)

        return run


@pytest.fixture
def fake(monkeypatch) -> tuple[DirectLaunch, _Jit, list[int]]:
    """A direct launch of `_runtime` whose Triton and devices are fakes; the list holds the
    current device."""
    device = [0]
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: device[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 100 + d, raising=False)
    monkeypatch.setattr(launch, "DIRECT_TRITON", (".".join(triton.__version__.split(".")[:2]),))
    kernel, jit = DirectLaunch(RUNTIME), _Jit()
    kernel.jit = jit
    return kernel, jit, device


def test_launch_calls_the_cached_launcher_with_tritons_arguments(fake) -> None:
    kernel, jit, device = fake
    t = torch.zeros(4)
    kernel[(3,)](t, 16, num_warps=4)  # first: Triton's path, which fills the cache
    assert len(jit.triton_launches) == 1 and not jit.direct_launches
    kernel[(5, 2)](t, 32, num_warps=4)  # same specialisation: direct
    kernel[(1, 2, 3)](t, n=48, num_warps=4, unused=None)
    assert len(jit.triton_launches) == 1
    assert jit.direct_launches == [
        (5, 2, 1, 100, "function", "metadata", None, None, None, t, 32, None),
        (1, 2, 3, 100, "function", "metadata", None, None, None, t, 48, None),
    ]
    kernel[(3,)](t, 17, num_warps=4)  # another specialisation, another device, other options
    device[0] = 1
    kernel[(3,)](t, 16, num_warps=4)
    kernel[(3,)](t, 16, num_warps=8)
    assert len(jit.triton_launches) == 4 and len(jit.direct_launches) == 2
    kernel[(3,)](t, 16, num_warps=8)
    assert jit.direct_launches[-1][3] == 101  # the current device's stream


def test_launch_takes_tritons_path_under_hooks_and_odd_arguments(fake) -> None:
    """Launch or pre-run hooks (nothing cached while they are installed), a callable grid,
    unmodelled or unhashable values and a missing argument go through Triton's launch."""
    kernel, jit, _ = fake
    t = torch.zeros(4)
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(print)
    try:
        kernel[(3,)](t, 16)
        kernel[(3,)](t, 16)
    finally:
        hook.remove(print)
    jit.pre_run_hooks.append(print)
    kernel[(3,)](t, 16)
    jit.pre_run_hooks.clear()
    assert len(jit.triton_launches) == 3 and not kernel._cache
    kernel[lambda args: (3,)](t, 16)
    kernel[(3,)](t, "s")
    kernel[(3,)](t, 16, num_warps=[4])
    kernel[(3,)]()
    assert len(jit.triton_launches) == 7 and not jit.direct_launches


def test_direct_launches_turned_off_take_tritons_path(fake) -> None:
    kernel, jit, _ = fake
    t = torch.zeros(4)
    kernel[(3,)](t, 16)
    launch.set_direct_launches(False)
    try:
        kernel[(3,)](t, 16)
    finally:
        launch.set_direct_launches(True)
    assert len(jit.triton_launches) == 2 and not jit.direct_launches
    kernel[(3,)](t, 16)
    assert len(jit.direct_launches) == 1


def test_direct_path_only_for_checked_triton_versions_and_compiled_kernels(monkeypatch) -> None:
    """A Triton whose launcher protocol was not checked, and Triton's interpreter (this test
    session's kernels), take Triton's own launch."""
    from tokenmill.kernels.norm import _add_rms_norm_kernel

    assert DirectLaunch(RUNTIME)._direct == (
        ".".join(triton.__version__.split(".")[:2]) in launch.DIRECT_TRITON
    )
    monkeypatch.setattr(launch, "DIRECT_TRITON", ())
    assert not DirectLaunch(RUNTIME)._direct
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    assert _add_rms_norm_kernel._direct is not interpreted


def test_host_size_helpers_equal_tritons() -> None:
    """`cdiv` and `next_power_of_2` (the launch arguments' host helpers) equal Triton's."""
    from tokenmill.kernels.launch import cdiv, next_power_of_2

    for n in [0, 1, 2, 3, 15, 16, 17, 1000, 1024, 1025, 8191, 8192, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
