"""Autoscaling replicas under a load spike (issue 27), recorded on the CPU.

Starts a local Ray instance and an autoscaling tokenmill deployment (`--min-replicas 1
--max-replicas 3`, scaling on queued + running requests per replica), then runs `tokenmill
bench serve --sweep-rates LOW,HIGH,LOW,LOW`: a rate step up, then down. A thread reads the
replica count from the endpoint's /metrics (`tokenmill:replicas`) every second. Writes the bench
reports with the replica counts (`--output`) and a plot (`--plot`): TTFT of every request and
its rolling p99, and the replica count, over time.

    PYTHONPATH=$PWD python benchmarks/replica_spike.py --output docs/bench/replica_spike.json \\
        --plot docs/bench/replica_spike.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import ray
from ray import serve

from tokenmill.config import DEMO_MODEL_DIR, EngineArgs
from tokenmill.deploy.app import deploy_app, shutdown_app
from tokenmill.deploy.options import DeployOptions
from tokenmill.entrypoints.server_options import ServerOptions

ROOT = Path(__file__).resolve().parents[1]


def replica_count(url: str) -> int | None:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("tokenmill:replicas "):
            return int(float(line.split()[1]))
    return None


def ray_replicas() -> tuple[int, int]:
    """(running, starting) replicas as Ray Serve counts them."""
    app = serve.status().applications.get("tokenmill")
    if app is None or "TokenmillReplica" not in app.deployments:
        return 0, 0
    states = app.deployments["TokenmillReplica"].replica_states
    return states.get("RUNNING", 0), states.get("STARTING", 0)


def sample_replicas(
    url: str, stop: threading.Event, out: list[tuple[float, int, int, int]]
) -> None:
    """Every second: (time, replicas reporting metrics, Ray's running and starting replicas)."""
    while not stop.wait(1.0):
        if (count := replica_count(url)) is not None:
            out.append((time.time(), count, *ray_replicas()))


def rolling_p99(times: np.ndarray, values: np.ndarray, window: float) -> np.ndarray:
    """p99 of the requests started in the `window` seconds before each; NaN after a gap (no
    line is drawn across a time without requests)."""
    p99 = [np.percentile(values[(times > t - window) & (times <= t)], 99) for t in times]
    gaps = np.diff(times, prepend=times[0]) > window / 2
    return np.where(gaps, np.nan, p99)


def phase_summary(report: dict, counts: list[tuple[float, int, int, int]]) -> dict:
    """A phase's rate, outcome, TTFT p50/p99 and the most replicas serving during it."""
    begin, end = report["started_at"], report["started_at"] + report["elapsed_s"]
    return {
        "request_rate": report["request_rate"],
        "completed": report["completed"],
        "failed": report["failed"],
        "ttft_p50_s": report["ttft_s"]["p50"],
        "ttft_p99_s": report["ttft_s"]["p99"],
        "replicas_max": max((c[1] for c in counts if begin <= c[0] <= end), default=None),
    }


def plot(reports: list[dict], counts: list[tuple[float, int, int, int]], path: str) -> None:
    t0 = reports[0]["started_at"]
    starts, ttfts = [], []
    for report in reports:
        for r in report["records"]:
            if r["ttft"] is not None:
                starts.append(report["started_at"] - t0 + r["start"])
                ttfts.append(r["ttft"])
    order = np.argsort(starts)
    starts, ttfts = np.asarray(starts)[order], np.asarray(ttfts)[order]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.scatter(starts, ttfts, s=6, alpha=0.4, label="TTFT of a request")
    ax.plot(starts, rolling_p99(starts, ttfts, 10.0), color="tab:red", label="TTFT p99 (10 s)")
    for report in reports:
        begin = report["started_at"] - t0
        ax.axvspan(begin, begin + report["elapsed_s"], alpha=0.06, color="gray")
        ax.text(begin + 1, ax.get_ylim()[1] * 0.95, f"{report['request_rate']:g} req/s", fontsize=9)
    ax.set_xlabel("s since start")
    ax.set_ylabel("TTFT (s)")
    twin = ax.twinx()
    times = [c[0] - t0 for c in counts]
    twin.step(times, [c[1] for c in counts], where="post", color="black", label="replicas serving")
    twin.step(times, [c[2] + c[3] for c in counts], where="post", color="gray", linestyle="--",
              label="replicas wanted (running + starting)")  # fmt: skip
    twin.set_ylabel("replicas")
    twin.set_ylim(0, max(c[2] + c[3] for c in counts) + 1)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="center right")
    ax.set_title("tokenmill replicas on Ray Serve: a load spike, autoscaling 1 → N → 1 (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL_DIR))
    parser.add_argument(
        "--rates", default="0.5,3,0.5,0.5", help="Sessions per second, phase by phase."
    )
    parser.add_argument("--phase-s", type=float, default=60.0, help="Seconds of each phase.")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--output", default="replica_spike.json")
    parser.add_argument("--plot", default="replica_spike.png")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    engine = EngineArgs(model=args.model, device="cpu")
    options = ServerOptions(port=args.port, served_model_name="demo")
    deploy = DeployOptions(min_replicas=1, max_replicas=3, target_ongoing_requests=2,
                           upscale_delay_s=2, downscale_delay_s=15)  # fmt: skip
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    url = f"http://127.0.0.1:{args.port}"
    counts: list[tuple[float, int, int, int]] = []
    stop = threading.Event()
    try:
        deploy_app(engine, options, deploy)
        sampler = threading.Thread(target=sample_replicas, args=(url, stop, counts))
        sampler.start()
        bench = [sys.executable, "-m", "tokenmill", "bench", "serve", "--base-url", url,
                 "--model", "demo", "--workload", "random", "--input-len", "64",
                 "--output-len", "16", "--num-requests", "5000", "--sweep-rates", args.rates,
                 "--duration", str(args.phase_s), "--output", args.output,
                 "--no-progress"]  # fmt: skip
        subprocess.run(bench, check=False)
        time.sleep(20)  # the replicas' way back down, after the load
        stop.set()
        sampler.join()
        shutdown_app()
    finally:
        serve.shutdown()
        ray.shutdown()
    reports = json.loads(Path(args.output).read_text())
    summary = [phase_summary(r, counts) for r in reports]
    t0 = reports[0]["started_at"]
    # Per second: [s since start, replicas serving, Ray's running replicas, Ray's starting ones].
    replicas = [[round(c[0] - t0, 1), *c[1:]] for c in counts]
    for report in reports:  # every gap of every request is summarised in itl_s already
        for record in report["records"]:
            record.pop("itl")
    result = {"phases": summary, "replicas": replicas,
              "reports": reports}  # fmt: skip
    Path(args.output).write_text(json.dumps(result, indent=1))
    plot(reports, counts, args.plot)
    for phase in summary:
        print(phase)
    print("replicas over time:", replicas)


if __name__ == "__main__":
    main()
