"""The serve benchmark's printed table."""

from __future__ import annotations

import pytest

from tokenmill.bench.serve import format_table


def _stats() -> dict[str, float | None]:
    return dict.fromkeys(("mean", "p50", "p90", "p99", "max"))


def test_table_names_why_requests_failed() -> None:
    records = [
        {"success": False, "error": "HTTP 404: model tiny does not exist"},
        {"success": False, "error": "HTTP 404: model tiny does not exist"},
        {"success": False, "error": None},
    ]
    report = {
        "workload": {"name": "random"}, "completed": 0, "failed": 3, "elapsed_s": 1.0,
        "request_throughput": 0.0, "output_throughput": 0.0, "total_token_throughput": 0.0,
        "goodput": 0.0, "prefix_cache_hit_rate": None, "records": records,
        **{k: _stats() for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "session_completion_s")},
    }  # fmt: skip
    table = format_table(report)
    assert "failed: 2 x HTTP 404: model tiny does not exist" in table
    assert "failed: 1 x unknown error" in table


def test_engine_summary_from_the_servers_metrics() -> None:
    """`bench serve` reads the server's step counters before and after the run: steps, host
    ms a step and the device's busy share of the run, by kind of step; labels summed; None
    when the server exports no step counters or ran no step."""
    from tokenmill.bench.serve import engine_summary, parse_counters

    def exposition(steps: int, host: float, device: float, mixed: int) -> str:
        return "\n".join([
            "# HELP tokenmill:scheduler_step_seconds Host time.",
            f'tokenmill:scheduler_step_seconds_count{{model_name="m"}} {steps}',
            f'tokenmill:scheduler_step_seconds_sum{{model_name="m"}} {host}',
            f'tokenmill:model_forward_seconds_count{{model_name="m"}} {steps}',
            f'tokenmill:model_forward_seconds_sum{{model_name="m"}} {device}',
            f'tokenmill:model_forward_seconds_mixed_steps_count{{model_name="m"}} {mixed}',
            f'tokenmill:model_forward_seconds_mixed_steps_sum{{model_name="m"}} {device / 2}',
            f'tokenmill:model_forward_seconds_decode_steps_count{{model_name="m"}} {steps - mixed}',
            f'tokenmill:model_forward_seconds_decode_steps_sum{{model_name="m"}} {device / 2}',
            f'tokenmill:scheduler_step_seconds_mixed_steps_count{{model_name="m"}} {mixed}',
            f'tokenmill:scheduler_step_seconds_mixed_steps_sum{{model_name="m"}} {host * 0.8}',
            'tokenmill:prefix_cache_hits_total{model_name="m",x="a"} 2.0',
            'tokenmill:prefix_cache_hits_total{model_name="m",x="b"} 3.0',
        ])  # fmt: skip

    before = parse_counters(exposition(10, 0.5, 2.0, 4))
    assert before["prefix_cache_hits_total"] == 5.0 and "prefix_cache_queries_total" not in before
    after = parse_counters(exposition(110, 1.5, 8.0, 54))
    summary = engine_summary(before, after, elapsed=10.0)
    assert summary == {
        "steps": 100, "host_ms_per_step": pytest.approx(10.0), "forwards": 100,
        "device_busy_fraction": pytest.approx(0.6),
        "steps_by_kind": {
            # (the mixed launches' host time: 1.2 - 0.4 s over 50)
            "mixed": {"steps": 50, "device_s": pytest.approx(3.0), "host_ms": pytest.approx(16.0)},
            "decode": {"steps": 50, "device_s": pytest.approx(3.0)},  # (no host counters)
        },
    }  # fmt: skip
    assert engine_summary(before, before, elapsed=1.0) is None  # no step
    assert engine_summary({}, after, elapsed=1.0) is None
