"""The start-up benchmark's clock on a real `tokenmill serve` (benchmarks/startup.py times every
start this way): it listens no later than it is ready, the api server's phases add up to its
start-up, and the engine core's ran beside them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tokenmill.bench.server_process import cache_environment, running_server


def test_start_is_timed_to_its_first_completion_and_the_engine_starts_beside_the_server(
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
        # No CUDA graphs on the CPU: nothing to wait for (the gauge is exported all the same)
        assert server.wait_graphs_captured(timeout_s=10) < 5
    # The server answers /health from when it listens (503 until the engine is ready; the
    # engine core, started first, may be ready by then: 503 before ready is
    # tests/reliability/test_startup.py's).
    assert 0 < times.listening_s <= times.ready_s <= times.first_completion_s
    server_phases = {"server_imports", "server_setup", "waiting_for_engine", "ready_message"}
    engine_phases = {"engine_imports", "engine_config", "load_weights", "kv_cache", "engine_setup"}
    assert server_phases | engine_phases | {"total"} == phases.keys()
    # From the server process's start to ready, which the client sees a poll (50 ms) later.
    assert phases["total"] == pytest.approx(times.ready_s, abs=1.0)
    assert sum(phases[p] for p in server_phases) == pytest.approx(phases["total"], abs=0.01)
    # The engine core started first, before the server's imports, and its start-up fits in
    # the total (how much it overlaps depends on the machine's free cores).
    assert sum(phases[p] for p in engine_phases) <= phases["total"]
    log = (tmp_path / "log").read_text()
    assert log.index("started engine-core") < log.index("Started server process")  # uvicorn's
    assert server.stop() == 0  # stopped on leaving, gracefully
