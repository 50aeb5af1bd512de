"""Replicas on Ray Serve, end to end on the CPU: two replicas of the tiny model behind one
endpoint; sessions stay on their replica; every request is answered exactly once through a
replica killed mid-stream, a scale-down (draining) and a scale-up; metrics per replica."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import long_test
from tests.replicas.conftest import MODEL_NAME, server_args

pytest.importorskip("ray", reason="replicas need Ray Serve: pip install 'tokenmill[ray]'")

import ray
from ray import serve

from tokenmill.deploy.app import build_app, shutdown_app
from tokenmill.deploy.ingress import merge_metrics
from tokenmill.deploy.options import DeployOptions
from tokenmill.deploy.replica import REPLICA_HEADER

APP = "tokenmill"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MAX_TOKENS = 48


@dataclass
class Answer:
    """What a client saw of one streamed completion."""

    replica: str = ""
    ids: set[str] = field(default_factory=set)
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    done: int = 0
    first_chunk: threading.Event = field(default_factory=threading.Event)


def stream(url: str, prompt: str, answer: Answer, max_tokens: int = MAX_TOKENS) -> Answer:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        answer.replica = response.headers[REPLICA_HEADER]
        for line in response.iter_lines():
            if line == "data: [DONE]":
                answer.done += 1
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if "error" in data:
                    answer.error = data["error"]["message"]
                    continue
                answer.ids.add(data["id"])
                answer.tokens += len(data["choices"])
                answer.finish_reason = data["choices"][0]["finish_reason"] or answer.finish_reason
                answer.first_chunk.set()
    return answer


def deploy(llama_dir: Path, replicas: int) -> None:
    engine, options = server_args(llama_dir)
    serve.run(build_app(engine, options, DeployOptions(replicas=replicas), APP), name=APP)


@pytest.fixture(scope="module")
def url(ray_url: str, llama_dir: Path) -> Iterator[str]:
    deploy(llama_dir, replicas=2)
    yield ray_url
    shutdown_app(APP)


def assert_complete(answer: Answer) -> None:
    assert answer.error is None, answer.error
    assert (len(answer.ids), answer.tokens, answer.finish_reason, answer.done) == (
        1, MAX_TOKENS, "length", 1
    ), answer  # fmt: skip


def replicas_answering(url: str, n: int = 6) -> set[str]:
    return {stream(url, f"probe {i}", Answer(), max_tokens=1).replica for i in range(n)}


def test_a_sessions_turns_go_to_one_replica(url: str) -> None:
    homes: dict[str, set[str]] = {}
    for turn in range(3):
        for session in ("ann", "bob", "cyd", "dee"):
            message = {"role": "user", "content": f"turn {turn} of {session}"}
            body = {"model": MODEL_NAME, "max_tokens": 2, "user": session, "messages": [message]}
            response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            homes.setdefault(session, set()).add(response.headers[REPLICA_HEADER])
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert len(set.union(*homes.values())) == 2, "new sessions spread over the replicas"


def test_metrics_are_labelled_per_replica(url: str) -> None:
    text = httpx.get(url + "/metrics", timeout=30).text
    assert "tokenmill:replicas 2" in text
    finished = [
        line for line in text.splitlines() if line.startswith("tokenmill:num_requests_running{")
    ]
    assert len({line.split('replica="')[1].split('"')[0] for line in finished}) == 2
    merged = merge_metrics(
        {"a#x#r1": '# TYPE m counter\nm_total{k="v"} 1\n', "a#x#r2": "m_total 2\n"}
    )
    assert 'm_total{replica="r1",k="v"} 1' in merged and 'm_total{replica="r2"} 2' in merged


def test_a_client_leaving_mid_stream_aborts_its_request_on_the_replica(url: str) -> None:
    def aborted() -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        lines = [line for line in text.splitlines() if 'finished_reason="abort"' in line]
        return sum(float(line.split()[-1]) for line in lines if line.startswith("tokenmill:"))

    before = aborted()
    body = {"model": MODEL_NAME, "prompt": "leave", "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        next(response.iter_lines())  # the first chunk, then the client hangs up
    deadline = time.monotonic() + 30
    while aborted() < before + 1:
        assert time.monotonic() < deadline, "the replica kept generating for a client that left"
        time.sleep(0.2)


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium")
def test_the_dashboard_shows_every_replica(url: str, tmp_path: Path) -> None:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000"]  # fmt: skip
    command = [CHROMIUM, *flags, "--dump-dom", url + "/dashboard"]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=120).stdout
    assert re.search(r'<table id="replicas" data-rows="2"', dom), dom[-2000:]


@long_test("a new replica starts in about a minute on 2 cores")
def test_scale_down_drains_and_scale_up_joins_without_losing_requests(
    url: str, llama_dir: Path
) -> None:
    for target in (1, 2):
        with ThreadPoolExecutor(8) as pool:
            answers = [Answer() for _ in range(6)]
            running: list[Future] = [
                pool.submit(stream, url, f"scale {target} {i}", a) for i, a in enumerate(answers)
            ]
            assert all(a.first_chunk.wait(60) for a in answers)
            t0 = time.monotonic()
            deploy(llama_dir, replicas=target)  # returns once the new target is running
            print(f"scaled to {target} in {time.monotonic() - t0:.1f} s")
            for done in running:
                assert_complete(done.result(timeout=120))
        assert len(replicas_answering(url)) == target


def test_a_replica_killed_mid_stream_loses_and_duplicates_nothing(url: str) -> None:
    with ThreadPoolExecutor(16) as pool:
        answers = [Answer() for _ in range(8)]
        running = [pool.submit(stream, url, f"story {i}", a, 400) for i, a in enumerate(answers)]
        assert all(a.first_chunk.wait(60) for a in answers)
        victim = answers[0].replica
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        # New requests right after the kill: retried on, or routed to, the survivor.
        after = [pool.submit(stream, url, f"after {i}", Answer()) for i in range(4)]
        for done in [*running, *after]:
            done.result(timeout=120)
    for answer in answers:
        assert len(answer.ids) == 1 and answer.done == 1, answer
        if answer.replica == victim:
            assert answer.error is not None and "failed mid-stream" in answer.error
            assert answer.finish_reason is None and answer.tokens < 400
        else:
            assert answer.error is None and answer.tokens == 400, answer
    for done in after:
        assert_complete(done.result())
        assert done.result().replica != victim
