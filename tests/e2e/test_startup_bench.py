"""The start-up benchmark's clock on a real `tokenmill serve` (benchmarks/startup.py times every
start this way): it listens before it is ready, and its phases add up to its start-up."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tokenmill.bench.server_process import cache_environment, running_server


def test_start_is_timed_to_its_first_completion_and_its_phases_add_up(
    llama_dir: Path, tmp_path: Path
) -> None:
    caches = tmp_path / "caches"
    args = ["--device", "cpu", "--max-model-len", "1024"]
    env = cache_environment(caches)
    with running_server(str(llama_dir), args, tmp_path / "log", env, timeout_s=300) as (
        server,
        times,
    ):
        phases = server.startup_phases()
        assert httpx.get(server.base_url + "/health").status_code == 200
    # The server answered /health (with 503: not ready) before the engine had loaded the model.
    assert 0 < times.listening_s < times.ready_s <= times.first_completion_s
    assert {"server_imports", "engine_imports", "load_weights", "kv_cache"} <= phases.keys()
    # From the server process's start to ready, which the client sees a poll (50 ms) later.
    assert sum(phases.values()) == pytest.approx(times.ready_s, abs=1.0)
    assert server.stop() == 0  # stopped on leaving, gracefully
