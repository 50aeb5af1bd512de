"""The serve benchmark's printed table."""

from __future__ import annotations

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
