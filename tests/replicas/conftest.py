"""A local Ray instance per module, and tokenmill applications deployed on it (tiny model, CPU)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_url() -> Iterator[str]:
    """A local Ray instance with Serve's HTTP proxy; the proxy's base URL."""
    ray = pytest.importorskip("ray", reason="replicas need Ray Serve: pip install 'tokenmill[ray]'")
    from ray import serve

    # Ray's worker processes import tokenmill: this checkout's, installed or not.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
    port = _free_port()
    # Logical CPUs: Ray schedules replicas by them; the 2 cores are shared by everything.
    ray.init(num_cpus=4, include_dashboard=False, namespace="tokenmill", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path


def server_args(llama_dir: Path, **engine: object) -> tuple:
    """EngineArgs and ServerOptions of the tiny model on the CPU."""
    from tokenmill.config import EngineArgs
    from tokenmill.entrypoints.server_options import ServerOptions

    engine_args = EngineArgs(model=str(llama_dir), device="cpu", **engine)  # type: ignore[arg-type]
    return engine_args, ServerOptions(served_model_name=MODEL_NAME)
