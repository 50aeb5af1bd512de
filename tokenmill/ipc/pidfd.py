"""A process held by a Linux pidfd: whether it still runs, and killing it, without a pid that
may have been reused meanwhile.

The supervisor holds one for each worker it forks from the fork server: those workers are the
fork server's children, not the api server's, and multiprocessing learns of their end from the
fork server. Should the fork server die (SIGKILL, the OOM killer), multiprocessing reports every
one of them dead (exit code 255) while they run on, orphaned; the pidfd tells the truth.
"""

from __future__ import annotations

import os
import select
import signal


class ProcessRef:
    """A running process, by pidfd; `close()` it once done with."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @staticmethod
    def open(pid: int) -> ProcessRef | None:
        """The process `pid`; None where it is gone already or pidfds are not supported."""
        try:
            return ProcessRef(os.pidfd_open(pid))
        except (AttributeError, OSError):  # not Linux >= 5.3, or no such process
            return None

    def running(self) -> bool:
        """True until the process has exited (a zombie not reaped yet has exited)."""
        return not select.select([self._fd], [], [], 0)[0]

    def kill(self, timeout: float) -> bool:
        """SIGKILL the process and wait up to `timeout` seconds for it to exit; True if it did."""
        try:
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)
        except ProcessLookupError:
            return True  # exited (and reaped) already
        return bool(select.select([self._fd], [], [], timeout)[0])

    def close(self) -> None:
        os.close(self._fd)
