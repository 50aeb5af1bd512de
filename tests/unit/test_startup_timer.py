"""Start-up phases: each phase's seconds in the order they ran, adding up to the start-up."""

from __future__ import annotations

import time

import pytest

from tokenmill.observability.startup import StartupTimer, process_age, startup_line


def test_phases_are_timed_in_order_and_a_repeated_phase_adds_up() -> None:
    timer = StartupTimer()
    with timer.phase("load_weights"):
        time.sleep(0.02)
    with timer.phase("kv_cache"):
        pass
    with timer.phase("load_weights"):
        time.sleep(0.02)
    assert list(timer.phases) == ["load_weights", "kv_cache"]
    assert timer.phases["load_weights"] >= 0.04
    assert timer.phases["kv_cache"] < timer.phases["load_weights"]


def test_a_failing_phase_is_still_timed_and_the_error_goes_on() -> None:
    timer = StartupTimer()
    with pytest.raises(ValueError, match="no room"), timer.phase("kv_cache"):
        raise ValueError("no room")
    assert "kv_cache" in timer.phases


def test_sync_runs_at_the_end_of_every_phase_inside_its_time() -> None:
    synced: list[str] = []
    timer = StartupTimer(sync=lambda: (synced.append("sync"), time.sleep(0.02)))
    with timer.phase("cuda_graphs"):
        synced.append("work")
    assert synced == ["work", "sync"]
    assert timer.phases["cuda_graphs"] >= 0.02  # the device's queued work counts in its phase


def test_phases_from_elsewhere_and_the_rest_add_up_to_the_elapsed_time() -> None:
    timer = StartupTimer(started_ago=0.5)  # e.g. the process's imports before the timer
    timer.rest("imports")
    assert 0.5 <= timer.phases["imports"] < 1.0
    with timer.phase("setup"):
        time.sleep(0.01)
    time.sleep(0.35)  # meanwhile another process ran its phases:
    timer.add({"load_weights": 0.2, "cuda_graphs": 0.1})
    timer.rest("other")
    timer.rest("other")  # a second call recomputes it, never counts it twice
    assert list(timer.phases) == ["imports", "setup", "load_weights", "cuda_graphs", "other"]
    assert sum(timer.phases.values()) == pytest.approx(timer.elapsed, abs=0.005)
    assert timer.phases["other"] >= 0.04  # the 0.35 s wait less the 0.3 s of phases
    summary = timer.summary()
    assert summary.startswith(f"start-up {sum(timer.phases.values()):.2f} s (imports 0.5")
    assert "load_weights 0.20 s, cuda_graphs 0.10 s, other " in summary


def test_a_split_moves_part_of_a_phase_and_the_phases_still_add_up() -> None:
    timer = StartupTimer()
    timer.add({"server_imports": 1.0, "waiting_for_engine": 3.0})
    timer.split("waiting_for_engine", "ready_message", 1.25)
    assert timer.phases == {"server_imports": 1.0, "waiting_for_engine": 1.75,
                            "ready_message": 1.25}  # fmt: skip
    timer.split("server_imports", "late", 5.0)  # at most the whole phase
    timer.split("waiting_for_engine", "early", -0.5)  # clocks apart: none, but the phase is there
    assert timer.phases["server_imports"] == 0.0 and timer.phases["late"] == 1.0
    assert timer.phases["early"] == 0.0 and sum(timer.phases.values()) == 4.0


def test_the_rest_is_never_negative() -> None:
    timer = StartupTimer()
    timer.add({"load_weights": 10.0})  # phases that ran alongside this timer's own time
    timer.rest("other")
    assert timer.phases["other"] == 0.0


def test_the_process_age_is_the_time_since_this_process_started() -> None:
    age = process_age()
    assert 0 < age < time.time() - 1e9  # started, and after 2001
    time.sleep(0.05)
    assert process_age() >= age


def test_the_start_up_line_lists_each_process_phases_beside_the_total() -> None:
    server = {"server_imports": 4.0, "waiting_for_engine": 5.5}
    engine = {"engine_imports": 3.25, "load_weights": 6.0}
    line = startup_line(9.75, {"server": server, "engine core": engine})
    assert line == (
        "start-up 9.75 s (server: server_imports 4.00 s, waiting_for_engine 5.50 s; "
        "engine core: engine_imports 3.25 s, load_weights 6.00 s)"
    )
