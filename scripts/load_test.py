"""Load test: many concurrent requests with disconnects; every request must be accounted for.

Starts a real server (tests/e2e/server.py) on a checkpoint (default: the embedded demo model),
or targets a running one with --base-url. Prints the outcome counts and exits non-zero if any
request is unaccounted for (no status, a broken stream), any got a 5xx other than 503, or the
server's counters disagree with what the clients saw (see tokenmill/testing/load.py).

    PYTHONPATH=$PWD python scripts/load_test.py                  # 1,000 requests, 256 at a time
    PYTHONPATH=$PWD python scripts/load_test.py --base-url http://127.0.0.1:8000 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from tests.e2e.server import MODEL_NAME, run_server
from tokenmill.config import DEMO_MODEL_DIR
from tokenmill.testing.load import LoadReport, LoadSpec, run_load

# The load test: 1,000 requests, 256 at a time, a tenth of the clients leaving early.
DEFAULTS = {"num_requests": 1000, "concurrency": 256, "disconnect_fraction": 0.1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="A running server (default: start one).")
    parser.add_argument("--model", default=MODEL_NAME, help="The served model name.")
    parser.add_argument(
        "--model-dir", default=str(DEMO_MODEL_DIR), help="Checkpoint of the server to start."
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="Extra `serve` flag (repeatable)."
    )
    for f in dataclasses.fields(LoadSpec):  # --num-requests, --concurrency, ...
        flag = "--" + f.name.replace("_", "-")
        default = DEFAULTS.get(f.name, f.default)
        parser.add_argument(
            flag, type=type(f.default), default=default,
            help=f"{f.metadata['help']} (default: {default})",
        )  # fmt: skip
    parser.add_argument("--output", default=None, help="Write the JSON summary here.")
    return parser.parse_args(argv)


def spec_of(ns: argparse.Namespace) -> LoadSpec:
    return LoadSpec(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(LoadSpec)})


def run(ns: argparse.Namespace) -> LoadReport:
    if ns.base_url is not None:
        return asyncio.run(run_load(ns.base_url, ns.model, spec_of(ns)))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with run_server(Path(ns.model_dir), log, *ns.server_arg) as server:
            return asyncio.run(run_load(server.base_url, MODEL_NAME, spec_of(ns)))


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    report = run(ns)
    summary = report.summary()
    print(json.dumps(summary, indent=2))
    if ns.output:
        Path(ns.output).write_text(json.dumps(summary, indent=2))
    if not report.ok:
        print("FAIL: lost requests, 5xx errors or disagreeing counters", file=sys.stderr)
        return 1
    print(f"OK: {sum(report.outcomes.values())} requests accounted for in {report.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
