"""Issue 24's long-prompt numbers for one checkpoint, in one run: the serving benchmark's data
workload (documents of 2,000-8,000 tokens, 20-100 output tokens each) through HTTP, then the
same requests through `LLM.generate`, then B6 (prefill of long prompts) on that engine.

1. `tokenmill serve MODEL_DIR` with its default options (and what follows `--`), once its
   background capture of CUDA graphs is done, warmed up with 8 other documents, then
   `tokenmill bench serve --workload data` (`--num-requests`, at most `--max-concurrency`
   open), streaming token-id prompts.
2. The server stopped, `LLM(MODEL_DIR)` with its default options runs the same requests (token
   ids, lengths, greedy, ignoring EOS), all submitted at once, after a warm-up.
3. B6 on that engine: `--b6-requests` prompts of `--b6-input-len` random tokens, one output
   token each (its prompts are distinct, so the default prefix cache finds nothing).

Reports total tok/s of both paths, their ratio (HTTP / offline), and the share of the bf16
matmul rate (measured in the same run) their FLOPs used, attention included (`ModelCost
.sequence_flops`), with each engine's host ms a step and its device's busy share (the server's
from its /metrics); one line each for data and B6; `--output` writes everything as JSON.

    PYTHONPATH=$PWD python benchmarks/long_prompts.py DIR --output long.json \\
        [--cache-dir DIR_OF_startup.py] [-- --max-num-batched-tokens 16384]

`--cache-dir`: the folder `benchmarks/startup.py --cache-dir` filled, so that the server and the
engine here start warm. On the CPU: `python benchmarks/long_prompts.py
tokenmill/assets/demo-llama-16m --device cpu --num-requests 16 --length-scale 0.05
--b6-input-len 256 --b6-requests 8`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.offline import (
    data_workload,
    long_prompts_row,
    offline_llm,
    pct_of_matmul_rate,
    report_header,
    run_workload,
)
from tokenmill.bench.options import OfflineBenchArgs, ServeBenchArgs
from tokenmill.bench.roofline import Hardware
from tokenmill.bench.serve import run_serve_bench
from tokenmill.bench.server_process import (
    cache_environment,
    parse_with_serve_args,
    running_server,
    stop_on_sigterm,
)
from tokenmill.config import ModelConfig

WARMUP_REQUESTS = 8


def through_http(
    args: argparse.Namespace, offline: OfflineBenchArgs, serve_args: list[str]
) -> dict[str, Any]:
    """The data workload through a server of its own (stopped on return): the bench report."""
    spec = data_workload(offline, ModelConfig.from_pretrained(str(args.model_dir)))
    log = args.log_dir / f"long-prompts-{args.model_dir.resolve().name}-server.log"
    with running_server(str(args.model_dir), serve_args, log, timeout_s=args.timeout) as (
        server,
        _,
    ):
        import httpx

        # Graphs a step needs are captured before it (breaking the overlap: ~3 s of a
        # qwen3-0.6b run at 163 k tok/s): measured once all are, as a server that has been up.
        waited = server.wait_graphs_captured(args.timeout)
        print(f"background capture done {waited:.1f} s after the first completion", flush=True)
        model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        bench = ServeBenchArgs(
            base_url=server.base_url, model=model, workload=spec,
            max_concurrency=args.max_concurrency, timeout=args.timeout, progress=False,
        )  # fmt: skip
        # Other documents (another seed) first: what the first requests compile is not timed.
        warmup = dataclasses.replace(
            spec, num_sessions=WARMUP_REQUESTS, seed=spec.seed + 1
        )  # fmt: skip
        asyncio.run(run_serve_bench(dataclasses.replace(bench, workload=warmup)))
        report = asyncio.run(run_serve_bench(bench))
    report["server_log"] = str(log)
    return report


def http_row(name: str, http: dict[str, Any], offline: dict[str, Any], hw: Hardware | None) -> str:
    """One line: both paths' total tok/s, their shares of the matmul rate, and the ratio."""

    def share(seconds: float) -> str:
        return f"{pct_of_matmul_rate(offline['flops'], seconds, hw):.1f}%" if hw else "-"

    def engine(report: dict[str, Any] | None) -> str:
        if report is None:
            return ""
        return (
            f"; host {report['host_ms_per_step']:.1f} ms a step, device busy "
            f"{100 * report['device_busy_fraction']:.1f}%"
        )

    ratio = http["total_token_throughput"] / offline["total_tok_s"]
    http_share = share(http["elapsed_s"])
    return (
        f"data {name}: HTTP {http['total_token_throughput']:.0f} total tok/s ({http_share} "
        f"of the matmul rate; {http['completed']}/{http['requests']} ok, TTFT p50 "
        f"{http['ttft_s']['p50'] or 0:.2f} s{engine(http.get('engine'))}), LLM.generate "
        f"{offline['total_tok_s']:.0f} ({share(offline['elapsed_s'])}{engine(offline)}); "
        f"HTTP/offline {ratio:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="Checkpoint directory.")
    parser.add_argument("--num-requests", type=int, default=512, help="Data workload requests.")
    parser.add_argument(
        "--max-concurrency", type=int, default=256, help="Open HTTP requests at most."
    )
    parser.add_argument(
        "--length-scale", type=float, default=1.0,
        help="Scale the data workload's lengths (e.g. 0.05 on a CPU).",
    )  # fmt: skip
    parser.add_argument("--b6-input-len", type=int, default=8192, help="B6 prompt tokens.")
    parser.add_argument("--b6-requests", type=int, default=256, help="B6 prompts (0: no B6).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of lengths and token ids.")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present).")
    parser.add_argument(
        "--cache-dir", type=Path, default=None,
        help="benchmarks/startup.py's --cache-dir: start with the caches it filled for this "
        "model (CACHE_DIR/<model dir name>).",
    )  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=None, help="Write the server log here.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds for a step.")
    parser.add_argument("--output", default=None, help="Write the JSON report here.")
    args, serve_args = parse_with_serve_args(parser, sys.argv[1:] if argv is None else argv)
    stop_on_sigterm()
    for flag in ("num_requests", "max_concurrency", "b6_input_len", "timeout", "length_scale"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.b6_requests < 0:
        parser.error(f"--b6-requests must be >= 0, got {args.b6_requests}")
    name = args.model_dir.resolve().name
    if args.cache_dir is not None:  # for the server (a child) and this process's engine
        os.environ.update(cache_environment(args.cache_dir / name))
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tokenmill-long-prompts-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.device:
        serve_args = ["--device", args.device, *serve_args]
    offline = OfflineBenchArgs(
        config=str(args.model_dir), workload="data", dtype="auto", device=args.device,
        num_requests=args.num_requests, length_scale=args.length_scale, seed=args.seed,
        peer=False, engine_kwargs={"load_format": "auto"},
    )  # fmt: skip
    http = through_http(args, offline, serve_args)
    llm = offline_llm(offline)
    report, hw = report_header(offline, llm)
    rng = np.random.default_rng(args.seed)
    report["offline"], _ = run_workload(llm, offline, hw, rng)
    report["http"] = http
    report["http_over_offline"] = http["total_token_throughput"] / report["offline"]["total_tok_s"]
    if hw is not None:
        report["http"]["pct_of_matmul_rate"] = pct_of_matmul_rate(
            report["offline"]["flops"], http["elapsed_s"], hw
        )
    print(http_row(name, http, report["offline"], hw), flush=True)
    if args.b6_requests:
        b6 = dataclasses.replace(
            offline, workload="b6", input_len=args.b6_input_len, num_requests=args.b6_requests
        )
        report["b6"], _ = run_workload(llm, b6, hw, rng)
        print(long_prompts_row("b6", name, report["b6"]), flush=True)
    llm.close()
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2, default=str))
    return 0 if http["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
