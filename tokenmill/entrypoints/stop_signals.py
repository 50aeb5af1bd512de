"""How `tokenmill serve` takes SIGTERM and SIGHUP: as a request to stop cleanly, at any time.

uvicorn handles SIGTERM once it serves (the server then ends its requests and stops its
processes in order). Before that, during the server's imports and set-up (seconds, while the
engine core and the workers started ahead of it load), SIGTERM's default action ended the
server on the spot: its socket folder was left behind and its processes ran on until each
noticed. SIGHUP (a closed terminal or ssh session) did so at any time, in-flight requests cut
off. Here SIGTERM raises `Stopped` in the main thread until uvicorn takes it over, so that the
start-up unwinds through its clean-ups; SIGHUP is passed on as a SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType


class Stopped(BaseException):
    """A SIGTERM (or SIGHUP) that arrived before the server serves: like KeyboardInterrupt, not
    an `Exception`, so that nothing on the way catches it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} while starting")


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within it, in this process (its main thread), SIGTERM raises `Stopped` (once: later ones
    are ignored, so that the clean-ups it starts run to their end) and SIGHUP is a SIGTERM;
    the handlers before it are restored at its end."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _terminate)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(signum: int, frame: FrameType | None) -> None:
    # Not SIG_IGN: processes started from here on (a fork server's restart) would inherit it,
    # and the clean-ups could not terminate them.
    signal.signal(signal.SIGTERM, _ignore)
    raise Stopped(signum)


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass


def _terminate(signum: int, frame: FrameType | None) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
