"""Launching a compiled Triton kernel without Triton's per-launch binder.

`kernel[grid](*args)` on a `@triton.jit` function binds every argument, asks Triton's
specialiser about each (dtype, 16-byte alignment of pointers, integers equal to 1 or
multiples of 16, integer width), builds a string key, looks the compiled kernel up and
assembles launch metadata for hooks: ~20 us of host time a launch on the H200's host, against
~8 us for the compiled kernel's own launcher (`docs/perf-notes.md`, session 30). A prefill step
of a small model launches ~140 Triton kernels, and its host time was the data workload's limit.

`direct_launch` wraps a kernel so that `kernel[grid](*args, **kwargs)` keeps Triton's
semantics but, after the first launch of each specialisation, calls the compiled kernel's
launcher straight away. Its key is a refinement of Triton's: equal keys imply equal
specialisations, so a cached kernel is only ever launched with arguments it was compiled for.

- a tensor: its dtype and whether its address is a multiple of 16;
- an int: whether it is 1, a multiple of 16, and in the 32-bit or 64-bit signed range;
- a float, a bool, None: the type alone (Triton does not specialise on their value);
- a constexpr parameter: an int's, bool's or None's value with its type, any other's `repr`
  (Triton keys on the `str` of its specialisation: `0.0` is not `-0.0`, `(1,)` not `(True,)`);
- every launch option (`num_warps`, `launch_pdl`, ...): its value and type;
- the current CUDA device, and the two knobs Triton adds to every launch's options
  (`knobs.runtime.debug`, `knobs.compilation.instrumentation_mode`).

Other argument types, a callable grid, launch and pre-run hooks (`triton.knobs.runtime.
launch_enter_hook`, `JITFunction.add_pre_run_hook`), Triton's interpreter, ROCm (whose backend
also specialises tensors on their size) and Triton versions whose launcher this was not checked
against (DIRECT_TRITON) take Triton's own path, as does every first launch (which compiles or
finds the kernel in Triton's cache and is what fills ours). Not repeated on the direct path:
Triton's check that the globals a kernel read when compiled have not changed since (no kernel
here writes a global).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

# Triton versions (major.minor) whose launcher protocol this calls: `CompiledKernel.run(grid x,
# y, z, stream, function, packed metadata, launch metadata, enter hook, exit hook, *args)`.
DIRECT_TRITON = ("3.6",)

_enabled = True


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for the host's launch arguments: Triton's (a `ConstexprFunction` since 3.5,
    which unwraps its arguments) costs ~5 us a call, and a prefill step makes hundreds."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for the host's launch arguments (see `cdiv`): 0 for 0."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def set_direct_launches(enabled: bool) -> None:
    """Turn direct launches on or off for every kernel from now on (for A/B measurements:
    off, each launch takes Triton's own path)."""
    global _enabled
    _enabled = enabled


class _Unkeyed(Exception):
    """An argument whose specialisation the key does not model: take Triton's path."""


def _other_key(arg: Any) -> Any:
    """The key of a runtime argument that is neither a plain tensor nor an int."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, not arg.data_ptr() & 15
    if arg.__class__ is float or arg.__class__ is bool or arg is None:
        return arg.__class__
    raise _Unkeyed


def _other_constexpr_key(arg: Any) -> Any:
    """The key of a constexpr that is not an int, a bool or None: its `repr`, as in Triton's."""
    return arg.__class__, repr(arg)


def _constexpr_key(name: str) -> str:
    """Source of a constexpr's key: an int's, bool's or None's value with its type; otherwise
    `_other_constexpr_key`."""
    return (
        f"(({name}.__class__, {name}) if {name}.__class__ is int or {name}.__class__ is bool "
        f"or {name} is None else _other_constexpr_key({name}))"
    )


def _runtime_key(name: str) -> str:
    """Source of a runtime argument's key: a tensor's dtype and 16-byte alignment; an int's
    equality to 1, divisibility by 16 and width; otherwise `_other_key`."""
    return (
        f"(({name}.dtype, not {name}.data_ptr() & 15) if {name}.__class__ is Tensor else "
        f"(({name} == 1, not {name} & 15, -2147483648 <= {name} <= 2147483647, "
        f"{name} <= 9223372036854775807) if {name}.__class__ is int else _other_key({name})))"
    )


def _key_function(jit: JITFunction) -> Callable[..., tuple[tuple, tuple]]:
    """A function with the kernel's signature (and `**options`) that returns the launch's key
    and every argument in order. Generated, as Triton's binder is: one flat expression is
    several times cheaper than a loop over the arguments."""
    params = list(jit.signature.parameters.values())
    names = [p.name for p in params]
    signature = [
        f"{p.name}=_default_{p.name}" if p.default is not p.empty else p.name for p in params
    ]
    keys = [
        _constexpr_key(n) if p.is_constexpr else _runtime_key(n)
        for n, p in zip(names, jit.params, strict=True)
    ]
    source = (
        f"def key({', '.join([*signature, '**options'])}):\n"
        f"    return (tuple(options.items()), tuple(map(type, options.values())), "
        f"{', '.join(keys)}), ({', '.join(names)},)\n"
    )
    namespace: dict[str, Any] = {
        "Tensor": torch.Tensor,
        "_other_key": _other_key,
        "_other_constexpr_key": _other_constexpr_key,
    }
    namespace.update({f"_default_{p.name}": p.default for p in params if p.default is not p.empty})
    exec(source, namespace)
    return namespace["key"]


class DirectLaunch:
    """A `@triton.jit` kernel whose launches after the first of each specialisation call the
    compiled kernel's launcher directly. `kernel[grid](*args, **kwargs)` as with Triton
    (`grid`: 1 to 3 ints); `jit` is the wrapped function (for compiling it by hand)."""

    def __init__(self, jit: JITFunction) -> None:
        self.jit = jit
        version = ".".join(triton.__version__.split(".")[:2])
        # not Triton's interpreter, a launcher protocol known, and CUDA's specialisation
        self._direct = (
            isinstance(jit, JITFunction) and version in DIRECT_TRITON and torch.version.hip is None
        )
        self._cache: dict[tuple, tuple[Callable[..., Any], Any, Any]] = {}
        if self._direct:
            self._key = _key_function(jit)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if not (self._direct and _enabled) or callable(grid):
            return self.jit[grid]
        return functools.partial(self.launch, grid)

    def reset(self) -> None:
        """Forget every compiled kernel, Triton's (in this process) and the direct launches':
        the next launch of each specialisation compiles it again or loads it from disk."""
        self._cache.clear()
        if isinstance(self.jit, JITFunction):
            self.jit.device_caches.clear()

    def compiled(self) -> int:
        """How many specialisations Triton holds compiled in this process, over all devices."""
        if not isinstance(self.jit, JITFunction):
            return 0
        return sum(len(cache[0]) for cache in self.jit.device_caches.values())

    def launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        """Launch over `grid` with the kernel's arguments and launch options."""
        device = torch._C._cuda_getDevice()
        knobs = triton.knobs
        try:
            key, full = self._key(*args, **kwargs)
            key = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode, key)
            entry = self._cache.get(key)
        except (_Unkeyed, TypeError):  # unmodelled or unhashable values, a missing argument
            self.jit[grid](*args, **kwargs)
            return
        if entry is None or _hooks_installed(self.jit):
            compiled = self.jit[grid](*args, **kwargs)
            if not _hooks_installed(self.jit):
                self._cache[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = entry
        n = len(grid)
        run(
            grid[0],
            grid[1] if n > 1 else 1,
            grid[2] if n > 2 else 1,
            torch._C._cuda_getCurrentRawStream(device),
            function,
            metadata,
            None,
            None,
            None,
            *full,
        )


def _hooks_installed(jit: JITFunction) -> bool:
    """Whether a launch hook (a profiler's) or a pre-run hook of `jit` is installed: Triton's
    path calls them."""
    runtime = triton.knobs.runtime
    return bool(
        jit.pre_run_hooks or runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls
    )


def direct_launch(jit: JITFunction) -> DirectLaunch:
    """Decorator (over `@triton.jit`): launch the kernel through `DirectLaunch`."""
    return DirectLaunch(jit)
