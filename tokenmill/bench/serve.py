"""`tokenmill bench serve`: an asyncio load generator for any OpenAI-compatible server.

Streams `/v1/completions` (token-id prompts) under Poisson or gamma arrivals or a concurrency
cap, measures every request client-side (TTFT, every inter-token gap, TPOT, E2E) and reports
percentiles, throughput, goodput under an SLO, failures and the server's prefix-cache hit rate.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from tokenmill.bench.options import ServeBenchArgs
from tokenmill.bench.workloads import Session, build_workload, reply_placeholder
from tokenmill.ipc.messages import STEP_KINDS


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds from the run's start)."""

    session: int
    turn: int
    prompt_tokens: int
    max_tokens: int
    start: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    success: bool = False
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def _stream_one(
    client: httpx.AsyncClient, args: ServeBenchArgs, prompt: list[int], record: RequestRecord,
    t0: float,
) -> None:  # fmt: skip
    body = {
        "model": args.model, "prompt": prompt, "max_tokens": record.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    last = None
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    record.error = str(data["error"].get("message"))
                    return
                if data.get("usage"):
                    record.output_tokens = data["usage"]["completion_tokens"]
                if not data.get("choices") or not data["choices"][0].get("text"):
                    continue
                now = time.perf_counter() - t0
                if last is None:
                    record.ttft = now - record.start
                else:
                    record.itl.append(now - last)
                last = now
                chunks += 1
        record.e2e = time.perf_counter() - t0 - record.start
        record.output_tokens = record.output_tokens or chunks
        record.success = True
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def _run_session(
    client: httpx.AsyncClient, args: ServeBenchArgs, index: int, session: Session,
    records: list[RequestRecord], t0: float, limit: asyncio.Semaphore | None, bar: tqdm,
) -> None:  # fmt: skip
    history: list[int] = []
    for turn_index, turn in enumerate(session.turns):
        history += turn.new_tokens
        record = RequestRecord(
            index, turn_index, len(history), turn.max_tokens, time.perf_counter() - t0
        )
        records.append(record)
        if limit is not None:
            async with limit:
                record.start = time.perf_counter() - t0
                await _stream_one(client, args, history, record, t0)
        else:
            await _stream_one(client, args, history, record, t0)
        bar.update(1)
        if not record.success:
            return  # a session stops at its first failure
        history += reply_placeholder(record.output_tokens, args.workload.vocab_size, index)


async def run_serve_bench(args: ServeBenchArgs) -> dict[str, Any]:
    """Run the workload against `args.base_url`; returns the report with every record."""
    sessions = build_workload(args.workload)
    rng = np.random.default_rng(args.workload.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    records: list[RequestRecord] = []
    timeout = httpx.Timeout(args.timeout, connect=30)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits) as client:
        before = await _server_counters(client)
        total = sum(len(s.turns) for s in sessions)
        bar = tqdm(total=total, desc=f"{args.workload.name}", disable=not args.progress)
        started_at = time.time()
        t0 = time.perf_counter()
        tasks = []
        for index, session in enumerate(sessions):
            if args.duration is not None and time.perf_counter() - t0 > args.duration:
                break
            tasks.append(asyncio.create_task(
                _run_session(client, args, index, session, records, t0, limit, bar)
            ))  # fmt: skip
            if args.request_rate != float("inf"):
                gap = rng.gamma(args.burstiness, 1.0 / (args.request_rate * args.burstiness))
                await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        bar.close()
        after = await _server_counters(client)
    # Wall-clock start: runs of a sweep (e.g. a rate step up and down) line up on one time axis.
    return {"started_at": started_at, **summarize(records, elapsed, args, before, after)}


# What the report takes from the server's /metrics before and after the run (summed over
# labels): its prefix cache's counters, and its engine steps' host and device seconds
# (histogram sums and counts; `engine_summary`).
SERVER_COUNTERS = (
    "prefix_cache_queries_total", "prefix_cache_hits_total", "scheduler_step_seconds_count",
    "scheduler_step_seconds_sum", "model_forward_seconds_count", "model_forward_seconds_sum",
    *(f"{name}_{kind}_steps_{part}"
      for name in ("model_forward_seconds", "scheduler_step_seconds")
      for kind in STEP_KINDS for part in ("count", "sum")),
)  # fmt: skip


async def _server_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The SERVER_COUNTERS the server exports on /metrics (none if it has no /metrics)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    return parse_counters(text)


def parse_counters(text: str) -> dict[str, float]:
    """The SERVER_COUNTERS found in a Prometheus exposition `text`, each summed over its
    labels."""
    counters = {}
    for name in SERVER_COUNTERS:
        found = re.findall(rf"^\w+:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        if found:
            counters[name] = sum(float(v) for v in found)
    return counters


def engine_summary(
    before: dict[str, float], after: dict[str, float], elapsed: float
) -> dict[str, Any] | None:
    """What the server's engine did during a run of `elapsed` seconds: its steps, host ms a
    step (not waiting for the device), its forward passes, the share of the run its device was
    busy, and for each kind of step its forward passes, their device seconds and the host ms a
    step of the engine steps that launched them; None without those counters."""

    def delta(name: str) -> float:
        return after[name] - before[name]

    needed = ("scheduler_step_seconds_count", "scheduler_step_seconds_sum",
              "model_forward_seconds_sum", "model_forward_seconds_count")  # fmt: skip
    if not all(k in before and k in after for k in needed) or delta(needed[0]) <= 0:
        return None
    steps = delta(needed[0])
    kinds: dict[str, dict[str, float]] = {}
    for kind in STEP_KINDS:
        count, total = (f"model_forward_seconds_{kind}_steps_{p}" for p in ("count", "sum"))
        if count in before and count in after and delta(count) > 0:
            kinds[kind] = {"steps": int(delta(count)), "device_s": delta(total)}
        launches, host = (f"scheduler_step_seconds_{kind}_steps_{p}" for p in ("count", "sum"))
        if kind in kinds and launches in before and launches in after and delta(launches) > 0:
            kinds[kind]["host_ms"] = 1e3 * delta(host) / delta(launches)
    return {
        "steps": int(steps),
        "host_ms_per_step": 1e3 * delta(needed[1]) / steps,
        "forwards": int(delta(needed[3])),
        "device_busy_fraction": delta(needed[2]) / elapsed,
        "steps_by_kind": kinds,
    }


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    arr = np.asarray(values)
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def summarize(
    records: list[RequestRecord],
    elapsed: float,
    args: ServeBenchArgs,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    """Metrics as vLLM's `bench serve` defines them, plus every per-request record."""
    ok = [r for r in records if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)

    def good(r: RequestRecord) -> bool:
        ttft_ok = args.slo_ttft is None or (r.ttft is not None and r.ttft <= args.slo_ttft)
        tpot = r.tpot
        itl_ok = args.slo_itl is None or tpot is None or tpot <= args.slo_itl
        return ttft_ok and itl_ok

    hit_rate = None
    queries, hits = "prefix_cache_queries_total", "prefix_cache_hits_total"
    counted = all(k in before and k in after for k in (queries, hits))
    if counted and after[queries] > before[queries]:
        hit_rate = (after[hits] - before[hits]) / (after[queries] - before[queries])
    sessions: dict[int, list[RequestRecord]] = {}
    for r in ok:
        sessions.setdefault(r.session, []).append(r)
    completion = [max(x.start + (x.e2e or 0) for x in rs) - min(x.start for x in rs)
                  for rs in sessions.values()]  # fmt: skip
    return {
        "workload": asdict(args.workload),
        "base_url": args.base_url,
        "model": args.model,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "elapsed_s": elapsed,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "request_throughput": len(ok) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_token_throughput": (output_tokens + prompt_tokens) / elapsed,
        "goodput": sum(good(r) for r in ok) / elapsed,
        "slo": {"ttft_s": args.slo_ttft, "itl_s": args.slo_itl},
        "prefix_cache_hit_rate": hit_rate,
        "engine": engine_summary(before, after, elapsed),
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": _stats([gap for r in ok for gap in r.itl]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot) is not None]),
        "e2e_s": _stats([r.e2e for r in ok if r.e2e is not None]),
        "session_completion_s": _stats(completion),
        "records": [asdict(r) for r in records],
    }


def _failure_reasons(report: dict[str, Any], limit: int = 5) -> list[tuple[str, int]]:
    """The commonest errors of the failed requests, most frequent first."""
    errors = Counter(r["error"] for r in report["records"] if not r["success"])
    return [(error or "unknown error", n) for error, n in errors.most_common(limit)]


def format_table(report: dict[str, Any]) -> str:
    """The report as a readable table."""
    rows = [
        ("workload", report["workload"]["name"]),
        ("requests (completed / failed)", f"{report['completed']} / {report['failed']}"),
        ("elapsed", f"{report['elapsed_s']:.2f} s"),
        ("request throughput", f"{report['request_throughput']:.2f} req/s"),
        ("output token throughput", f"{report['output_throughput']:.1f} tok/s"),
        ("total token throughput", f"{report['total_token_throughput']:.1f} tok/s"),
        ("goodput", f"{report['goodput']:.2f} req/s"),
    ]
    if report["prefix_cache_hit_rate"] is not None:
        rows.append(("prefix cache hit rate", f"{100 * report['prefix_cache_hit_rate']:.1f} %"))
    if (engine := report.get("engine")) is not None:
        rows.append(("engine steps / host per step", f"{engine['steps']} / "
                     f"{engine['host_ms_per_step']:.2f} ms"))  # fmt: skip
        rows.append(("engine device busy", f"{100 * engine['device_busy_fraction']:.1f} %"))
    lines = [f"{k:<32}{v}" for k, v in rows]
    lines += [f"  failed: {count} x {error}" for error, count in _failure_reasons(report)]
    lines.append(f"{'(ms)':<18}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "session_completion_s"):
        s = report[key]
        cells = "".join(
            f"{'-' if s[q] is None else f'{1e3 * s[q]:.1f}':>10}"
            for q in ("mean", "p50", "p90", "p99", "max")
        )
        lines.append(f"{key[:-2].upper():<18}{cells}")
    return "\n".join(lines)
