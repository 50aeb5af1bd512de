"""PNG charts of serving benchmarks (matplotlib, headless)."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def _cdf(ax: Any, values: list[float], title: str) -> None:
    ax.set_title(title)
    if values:
        xs = np.sort(np.asarray(values) * 1e3)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
    ax.grid(alpha=0.3)


def plot_report(report: dict[str, Any], path: str) -> None:
    """Latency CDFs (TTFT, ITL, E2E) and throughput / in-flight requests over time."""
    records = [r for r in report["records"] if r["success"]]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    _cdf(axes[0][0], [r["ttft"] for r in records if r["ttft"] is not None], "TTFT CDF")
    _cdf(axes[0][1], [g for r in records for g in r["itl"]], "ITL CDF")
    _cdf(axes[1][0], [r["e2e"] for r in records if r["e2e"] is not None], "E2E latency CDF")
    ax = axes[1][1]
    elapsed = report["elapsed_s"]
    bins = np.linspace(0, max(elapsed, 1e-3), 41)
    # Each streamed chunk at its arrival time: start + TTFT, then every inter-token gap.
    arrivals = [r["start"] + r["ttft"] + sum(r["itl"][:i]) for r in records if r["ttft"] is not None
                for i in range(len(r["itl"]) + 1)]  # fmt: skip
    tokens, _ = np.histogram(arrivals, bins=bins)
    width = bins[1] - bins[0]
    ax.plot(bins[:-1], tokens / width, label="streamed chunks/s")
    ax.set_xlabel("s since start")
    ax.set_ylabel("streamed chunks/s (~tokens/s)")
    in_flight = [sum(r["start"] <= t < r["start"] + r["e2e"] for r in records) for t in bins]
    twin = ax.twinx()
    twin.plot(bins, in_flight, color="tab:red", label="requests in flight")
    twin.set_ylabel("requests in flight", color="tab:red")
    ax.set_title("Throughput and requests in flight")
    ax.grid(alpha=0.3)
    name = report["workload"]["name"]
    fig.suptitle(f"tokenmill bench serve — {name}, {report['completed']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(reports: list[dict[str, Any]], path: str) -> None:
    """Latency against achieved throughput, one point per offered request rate."""
    throughput = [r["output_throughput"] for r in reports]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, ax in (("ttft_s", axes[0]), ("tpot_s", axes[1])):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            values = [1e3 * (r[key][q] or float("nan")) for r in reports]
            ax.plot(throughput, values, style, label=q)
        for r, x in zip(reports, throughput, strict=True):
            ax.annotate(f"{r['request_rate']:g}/s", (x, 1e3 * (r[key]["p50"] or 0)), fontsize=8)
        ax.set_xlabel("output tok/s")
        ax.set_ylabel(f"{key[:-2].upper()} (ms)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("latency vs. throughput (request-rate sweep)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
