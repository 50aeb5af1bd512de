"""Start-up phases: how long each part of a cold start took (the ready log line, and
`tokenmill:startup_seconds{phase}`).

A process times its phases with a `StartupTimer`, from the moment the process started (its
imports are a phase); phases it does not time itself (the rest of its own time, or another
process's that ran before it) are added, so that its phases add up to its start-up. The api
server and the engine core start side by side (`entrypoints/early_start.py`): the server's
ready line lists each one's phases, and the time from the server's start to ready.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path


def process_age() -> float:
    """Seconds since this process started (from Linux's /proc; 0 where that cannot be read)."""
    try:
        # Field 22 of /proc/self/stat, in clock ticks after boot; fields are counted from the
        # one after the command name, which may hold spaces but ends at the last ")".
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))


class StartupTimer:
    """Seconds of each start-up phase, in the order they ran, since the timer started:
    `started_ago` seconds before it was made (e.g. `process_age()`).

    `sync` (e.g. `torch.cuda.synchronize`) is called at the end of each phase, so that work a
    phase queued on a device counts in that phase.
    """

    def __init__(self, sync: Callable[[], object] | None = None, started_ago: float = 0.0) -> None:
        self.phases: dict[str, float] = {}
        self._sync = sync
        self._started = time.perf_counter() - started_ago

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (a phase entered again adds to its seconds)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.add({name: time.perf_counter() - start})

    def add(self, phases: Mapping[str, float]) -> None:
        """Count phases timed elsewhere (e.g. in another process) as this timer's."""
        for name, seconds in phases.items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds

    def rest(self, name: str) -> None:
        """Phase `name` is what no other phase covers of the time since the timer started:
        after this, the phases add up to it."""
        timed = sum(seconds for other, seconds in self.phases.items() if other != name)
        self.phases[name] = max(0.0, self.elapsed - timed)

    def split(self, name: str, part: str, seconds: float) -> None:
        """Move `seconds` of phase `name` (at most all of it, at least none) into phase
        `part`, made if new: the phases still add up."""
        moved = min(max(0.0, seconds), self.phases.get(name, 0.0))
        self.phases[name] = self.phases.get(name, 0.0) - moved
        self.add({part: moved})

    @property
    def elapsed(self) -> float:
        """Seconds since the timer started."""
        return time.perf_counter() - self._started

    def summary(self) -> str:
        """One line: the phases' total, then each phase's seconds."""
        return startup_line(sum(self.phases.values()), {"": self.phases})


def startup_line(total: float, processes: Mapping[str, Mapping[str, float]]) -> str:
    """`start-up 9.80 s (server: server_imports 4.00 s, ...; engine core: ...)`: the start-up's
    seconds, then each process's phases (processes that start side by side: their phases add
    up to more than the total), a process named "" without its name."""
    parts = "; ".join(
        (f"{process}: " if process else "")
        + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items())
        for process, phases in processes.items()
    )
    return f"start-up {total:.2f} s ({parts})"
