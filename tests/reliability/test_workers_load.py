"""Under load: every request ends with a status, with disconnects and through a SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from pathlib import Path

import httpx

from tests.e2e.server import MODEL_NAME, run_server, wait_until
from tokenmill.testing.load import COMPLETED, DISCONNECTED, LoadSpec, run_load


def test_bounded_load_with_disconnects_accounts_for_every_request(
    llama_dir: Path, tmp_path: Path
) -> None:
    spec = LoadSpec(num_requests=200, concurrency=64, disconnect_fraction=0.1, max_tokens=8)
    with run_server(llama_dir, tmp_path / "log", "--max-model-len", "256") as server:
        report = asyncio.run(run_load(server.base_url, MODEL_NAME, spec))
        summary = json.dumps(report.summary())
        assert report.accounted, summary
        assert report.server_agrees, summary
        assert sum(report.outcomes.values()) == 200
        assert report.outcomes[COMPLETED] > 150 and report.outcomes[DISCONNECTED] > 5, summary
        # Disconnects were seen: some leavers' choices did not run to their end, aborted in the
        # engine or dropped unread at a tokenizer worker (under a loaded CPU, all of them can be
        # the latter, which the engine's abort counter does not see).
        normal = sum(report.server_finished.get(k, 0) for k in ("stop", "length"))
        stopped = report.finished_choices + report.disconnected_choices - normal
        assert stopped > 0, summary
        assert httpx.get(server.base_url + "/health").status_code == 200


def test_speculative_server_under_mixed_load_accounts_for_every_request(
    llama_dir: Path, tmp_path: Path
) -> None:
    """Prompt-lookup speculation (k fixed at 3) under the load's whole mix of features (chat,
    seeded sampling with penalties, logprobs, stop strings, JSON grammars, echo) and
    disconnects: every request ends with a status, the counters agree, drafts were verified."""
    spec = LoadSpec(num_requests=150, concurrency=48, max_tokens=8, feature_fraction=0.4, seed=3)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
              "prompt_lookup_min": 1, "adaptive": False}  # fmt: skip
    args = ("--max-model-len", "256", "--speculative-config", json.dumps(config))
    with run_server(llama_dir, tmp_path / "log", *args) as server:
        report = asyncio.run(run_load(server.base_url, MODEL_NAME, spec))
        summary = json.dumps(report.summary())
        assert report.accounted and report.server_agrees, summary
        assert report.statuses == {200: report.statuses[200]}, summary  # no request refused
        metrics = httpx.get(server.base_url + "/metrics").text
        drafts = next(
            float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("tokenmill:spec_decode_num_draft_tokens_total")
        )  # fmt: skip
        assert drafts > 0, summary


def test_sigterm_under_load_ends_every_in_flight_request_with_a_status(
    llama_dir: Path, tmp_path: Path
) -> None:
    # Long enough that all 16 are still running together on a loaded 2-core machine.
    body = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 1000, "ignore_eos": True}
    with run_server(llama_dir, tmp_path / "log", "--max-model-len", "1024") as server:
        outcomes: dict[int, str] = {}

        def client(i: int) -> None:
            url = server.base_url + "/v1/completions"
            try:
                if i % 2:
                    r = httpx.post(url, json=body, timeout=60)
                    reasons = {c["finish_reason"] for c in r.json()["choices"]}
                    outcomes[i] = f"{r.status_code} {sorted(reasons)}"
                    return
                with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                    lines = list(r.iter_lines())
                done = "data: [DONE]" in lines and '"finish_reason": "abort"' in "\n".join(lines)
                outcomes[i] = f"{r.status_code} stream {'ended' if done else 'cut'}"
            except httpx.HTTPError as exc:
                outcomes[i] = f"lost: {exc!r}"

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        load = server.base_url + "/load"
        assert wait_until(lambda: httpx.get(load).json().get("num_requests_running") == 16, 60)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=30)
        assert server.proc.wait(timeout=30) == 0
    assert len(outcomes) == 16
    for i, outcome in outcomes.items():
        expected = "200 ['abort']" if i % 2 else "200 stream ended"
        assert outcome == expected, outcomes
