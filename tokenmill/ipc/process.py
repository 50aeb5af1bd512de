"""Helpers every child process runs: a process title, logging set-up and dying with the parent."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import setproctitle

_LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def init_child(log_level: str, name: str) -> None:
    """Title the process `tokenmill::{name}` (as `ps` and `top` show it), configure logging and
    exit as soon as the parent process is gone (the server, or the fork server it started,
    which exits with it).

    Ctrl-C reaches the whole process group; children ignore SIGINT so that the parent can drain
    in-flight requests and then stop them in order.
    """
    setproctitle.setproctitle(f"tokenmill::{name}")
    logging.basicConfig(level=log_level, format=_LOG_FORMAT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # orphaned: the server died without stopping us
        time.sleep(0.5)
