"""Helpers every child process runs: a process title, logging set-up and dying with the parent."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import setproctitle

_LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def init_child(log_level: str, name: str, server_pid: int) -> None:
    """Title the process `tokenmill::{name}` (as `ps` and `top` show it), configure logging and
    exit as soon as the server process `server_pid` is gone.

    Ctrl-C reaches the whole process group; children ignore SIGINT so that the parent can drain
    in-flight requests and then stop them in order.
    """
    setproctitle.setproctitle(f"tokenmill::{name}")
    logging.basicConfig(level=log_level, format=_LOG_FORMAT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_server, args=(server_pid,), daemon=True).start()


def _watch_server(server_pid: int) -> None:
    # The server's pid, not our parent's: a worker's parent may be the fork server, which lives
    # as long as any worker does.
    while True:
        if not _alive(server_pid):
            os._exit(1)  # orphaned: the server died without stopping us
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    """True if `pid` runs; a killed process that its parent has not reaped yet counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc to tell a zombie by
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
