"""Soak test: load for N minutes while sampling every server process's memory (RSS).

Starts a real server (tests/e2e/server.py; default: the embedded demo model), runs load batches
(tokenmill/testing/load.py: streamed and plain requests, some disconnecting) back to back, and
samples the resident memory of the api server and each worker every few seconds. Fails (exit 1)
if a batch loses a request, or if a process's RSS at the end exceeds its RSS after the warm-up
(the first batch that ends --warmup-minutes into the run) by more than --max-growth-mb and
--max-growth-pct both. The warm-up fills what is bounded (the CPU engine core's oneDNN
primitives and malloc arenas: ~900 -> ~1,140 MiB in the first minute, flat after it, in
session 36's run on the demo model); growth after it is a leak.

    PYTHONPATH=$PWD python scripts/soak.py --minutes 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server
from tokenmill.config import DEMO_MODEL_DIR
from tokenmill.testing.load import LoadSpec, run_load


def rss_mb(pid: int) -> float | None:
    """Resident memory of `pid` in MiB (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return kib / 1024


def processes(server: ServerHandle) -> dict[str, int]:
    """Name → pid of the api server and its (current) workers."""
    return {"api-server": server.proc.pid, **server.child_pids()}


class Sampler(threading.Thread):
    """Samples every process's RSS every `interval_s` until stopped."""

    def __init__(self, server: ServerHandle, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.server, self.interval_s = server, interval_s
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.done.wait(self.interval_s):
            for name, pid in processes(self.server).items():
                if (mb := rss_mb(pid)) is not None:
                    self.samples.setdefault(name, []).append((time.monotonic() - start, mb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="How long to load.")
    parser.add_argument(
        "--warmup-minutes", type=float, default=1.0,
        help="Load before the RSS baseline is taken (less than --minutes).",
    )  # fmt: skip
    parser.add_argument(
        "--model-dir", default=str(DEMO_MODEL_DIR), help="Checkpoint of the server to start."
    )
    parser.add_argument("--server-arg", action="append", default=[], help="Extra `serve` flag.")
    parser.add_argument(
        "--requests-per-batch", type=int, default=200, help="Requests of each load batch."
    )
    parser.add_argument("--concurrency", type=int, default=64, help="Requests in flight at once.")
    parser.add_argument("--interval", type=float, default=2.0, help="Seconds between samples.")
    parser.add_argument(
        "--max-growth-mb", type=float, default=64.0,
        help="A process fails if it grew more than this after the warm-up (and the percent).",
    )  # fmt: skip
    parser.add_argument(
        "--max-growth-pct", type=float, default=10.0,
        help="... and more than this percent of its RSS after the warm-up.",
    )  # fmt: skip
    parser.add_argument("--output", default=None, help="Write the samples and verdict as JSON.")
    ns = parser.parse_args(argv)
    if not 0 <= ns.warmup_minutes < ns.minutes:
        parser.error("--warmup-minutes must be at least 0 and less than --minutes")
    with (
        tempfile.TemporaryDirectory() as tmp,
        run_server(Path(ns.model_dir), Path(tmp) / "server.log", *ns.server_arg) as server,
    ):
        return soak(server, ns)


def soak(server: ServerHandle, ns: argparse.Namespace) -> int:
    sampler = Sampler(server, ns.interval)
    sampler.start()
    start = time.monotonic()
    deadline = start + ns.minutes * 60
    warmed_up = start + ns.warmup_minutes * 60
    baseline: dict[str, float] = {}
    failures: list[str] = []
    batch = 0
    while time.monotonic() < deadline or not baseline or batch < 2:
        spec = LoadSpec(num_requests=ns.requests_per_batch, concurrency=ns.concurrency, seed=batch)
        report = asyncio.run(run_load(server.base_url, MODEL_NAME, spec))
        print(f"batch {batch}: {json.dumps(report.summary()['outcomes'])} "
              f"in {report.seconds:.1f} s", flush=True)  # fmt: skip
        if not report.ok:
            failures.append(f"batch {batch}: {json.dumps(report.summary())}")
        if not baseline and time.monotonic() >= warmed_up:
            # After the warm-up: caches, allocator pools and lazy imports are in place.
            baseline = {n: mb for n, p in processes(server).items() if (mb := rss_mb(p))}
            print(f"baseline after batch {batch}: {json.dumps(baseline)}", flush=True)
        batch += 1
    sampler.done.set()
    sampler.join()
    final = {n: mb for n, p in processes(server).items() if (mb := rss_mb(p))}
    for name, start_mb in baseline.items():
        end_mb = final.get(name, 0.0)
        growth = end_mb - start_mb
        print(f"{name}: RSS {start_mb:.0f} -> {end_mb:.0f} MiB ({growth:+.0f})")
        if growth > ns.max_growth_mb and growth > start_mb * ns.max_growth_pct / 100:
            failures.append(f"{name} grew {growth:.0f} MiB ({start_mb:.0f} -> {end_mb:.0f})")
    if ns.output:
        result = {"baseline": baseline, "final": final, "samples": sampler.samples}
        Path(ns.output).write_text(json.dumps({**result, "failures": failures}, indent=2))
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
