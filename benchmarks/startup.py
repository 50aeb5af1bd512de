"""B8, cold start (issue 24): seconds from launching `tokenmill serve MODEL_DIR` to its first
successful completion, cold then warm, with each start-up phase's seconds.

For each checkpoint directory: the cold start runs with every on-disk cache a start-up fills
(tokenmill's tuning cache, Triton's, torch inductor's, CUDA's JIT cache, ...; see
`tokenmill.bench.server_process.cache_environment`) pointed at an empty folder of its own; the
warm start is the second start, with the caches the first one filled. The checkpoint's files
stay in the OS page cache unless `--drop-page-cache`. Each start is timed from launch until the
server first answers HTTP (503 while the model loads), until /health says ready, and until a
16-token completion succeeds; the phases are the server's `tokenmill:startup_seconds{phase}`
and its `start-up ...` log line, which lists the api server's phases (server_imports,
server_setup, waiting_for_engine, ready_message: the engine's ready on its way to the server)
and the engine core's (engine_imports, engine_config, load_weights, kv_cache, gemv_tuning,
cuda_graphs, warm_up, engine_setup), which ran beside them
(a server captures its CUDA graphs in the background, after ready, unless given
`--cuda-graph-capture startup`: then `cuda_graphs` is a phase).
Prints a line per model and a line of phases per start; `--output` writes everything as JSON.
Arguments after `--` go to `tokenmill serve`.

    PYTHONPATH=$PWD python benchmarks/startup.py DIR [DIR ...] --output startup.json \\
        [--cache-dir /tmp/tm-caches] [-- --max-model-len 8192]

On a machine without a checkpoint: `tokenmill eval dummy-checkpoint --config shared/models/X
--output DIR` writes one (random weights). On the CPU, try the demo model:
`python benchmarks/startup.py tokenmill/assets/demo-llama-16m -- --device cpu`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.bench.server_process import (
    cache_environment,
    cache_files,
    drop_from_page_cache,
    parse_with_serve_args,
    running_server,
    startup_log_line,
    stop_on_sigterm,
)


def measure_start(
    model_dir: Path, serve_args: list[str], caches: Path, log: Path, timeout_s: float
) -> dict[str, Any]:
    """One start of `tokenmill serve`, with its caches under `caches`: its times and phases."""
    env = cache_environment(caches)
    with running_server(str(model_dir), serve_args, log, env, timeout_s) as (server, times):
        phases = server.startup_phases()
    exit_code = server.stop()  # stopped already: its exit code
    return {
        "listening_s": times.listening_s,
        "ready_s": times.ready_s,
        "first_completion_s": times.first_completion_s,
        "phases": phases,
        "log_line": startup_log_line(log.read_text(errors="replace")),
        "cache_files": cache_files(caches),
        "exit_code": exit_code,
        "log": str(log),
    }


def measure_model(
    model_dir: Path, serve_args: list[str], caches: Path, logs: Path, timeout_s: float,
    evict: bool,
) -> dict[str, Any]:  # fmt: skip
    """The cold and the warm start of one checkpoint."""
    if caches.exists() and any(caches.iterdir()):
        raise ValueError(f"the cache folder {caches} must be empty for a cold start")
    caches.mkdir(parents=True, exist_ok=True)
    name = model_dir.resolve().name
    report: dict[str, Any] = {
        "model": name, "model_dir": str(model_dir), "serve_args": serve_args,
        "cache_dir": str(caches), "cache_environment": cache_environment(caches),
        "page_cache_dropped_bytes": drop_from_page_cache(model_dir) if evict else 0,
    }  # fmt: skip
    for kind in ("cold", "warm"):
        print(f"{name}: {kind} start ...", file=sys.stderr, flush=True)
        report[kind] = measure_start(
            model_dir, serve_args, caches, logs / f"startup-{name}-{kind}.log", timeout_s
        )
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """`startup NAME: cold X s, warm Y s to the first completion (...)`, then each start's
    phases on a line of its own: the server log's line (the api server's phases, then the
    engine core's, which ran beside them), else the phases from /metrics; and the seconds from
    ready to the first completion (the tokenizer workers, the request itself)."""
    cold, warm = report["cold"], report["warm"]
    lines = [
        f"startup {report['model']}: cold {cold['first_completion_s']:.1f} s, warm "
        f"{warm['first_completion_s']:.1f} s to the first completion (listening "
        f"{cold['listening_s']:.1f} / {warm['listening_s']:.1f} s, ready {cold['ready_s']:.1f} "
        f"/ {warm['ready_s']:.1f} s)"
    ]
    for kind in ("cold", "warm"):
        start = report[kind]
        phases = start["log_line"] or ", ".join(
            f"{phase} {s:.1f}" for phase, s in start["phases"].items()
        )
        after = start["first_completion_s"] - start["ready_s"]
        lines.append(f"  {kind}: {phases}; ready to first completion {after:.2f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dirs", nargs="+", type=Path, help="Checkpoint directories.")
    parser.add_argument("--output", default=None, help="Write the JSON report here.")
    parser.add_argument(
        "--cache-dir", type=Path, default=None,
        help="Keep each model's caches in CACHE_DIR/<model dir name> (each must be empty or "
        "absent), e.g. for a later benchmark to start warm (default: a temporary folder, "
        "removed at the end).",
    )  # fmt: skip
    parser.add_argument(
        "--log-dir", type=Path, default=None,
        help="Write the servers' logs here (default: a temporary folder, kept).",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=600.0,
        help="Seconds a start may take to its first completion.",
    )  # fmt: skip
    parser.add_argument(
        "--drop-page-cache", action=argparse.BooleanOptionalAction, default=False,
        help="Drop the checkpoint's files from the OS page cache before the cold start, so "
        "that it reads the weights from the disk (flushing and reading a large checkpoint "
        "may take long on a slow disk).",
    )  # fmt: skip
    args, serve_args = parse_with_serve_args(parser, sys.argv[1:] if argv is None else argv)
    stop_on_sigterm()
    names = [d.resolve().name for d in args.model_dirs]
    if len(set(names)) < len(names):
        parser.error(f"the model directories must have distinct names, got {names}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="tokenmill-startup-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    root = args.cache_dir or Path(tempfile.mkdtemp(prefix="tokenmill-startup-caches-"))
    reports = []
    try:
        for model_dir, name in zip(args.model_dirs, names, strict=True):
            report = measure_model(
                model_dir, serve_args, root / name, logs, args.timeout, args.drop_page_cache
            )
            print("\n".join(summary_lines(report)), flush=True)
            reports.append(report)
            if args.output:  # after each model, so that a later failure keeps this one
                Path(args.output).write_text(json.dumps(reports, indent=2))
    finally:
        if args.cache_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
