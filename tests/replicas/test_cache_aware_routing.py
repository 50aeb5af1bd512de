"""The cache-aware router against round-robin, measured with `tokenmill bench serve`: three
shared prefixes over two replicas whose KV caches hold two prefixes each. Routed by prefix,
each replica keeps its own prefixes cached; round-robin sends every prefix to both replicas,
which evict them in turn."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.replicas.conftest import MODEL_NAME, server_args

pytest.importorskip("ray", reason="replicas need Ray Serve: pip install 'tokenmill[ray]'")
if not os.environ.get("TOKENMILL_LONG_TESTS"):
    pytest.skip(
        "two deployments of two replicas, about 2 minutes: TOKENMILL_LONG_TESTS=1 runs it",
        allow_module_level=True,
    )

from ray import serve

from tokenmill.deploy.app import build_app, shutdown_app
from tokenmill.deploy.options import DeployOptions
from tokenmill.entrypoints.cli import main

# Pages of 16 tokens: a prefix is 8 pages, a request 10; 24 pages hold two prefixes and a request.
NUM_PAGES = 24
BENCH = ["--workload", "shared-prefix", "--num-prefixes", "3", "--prefix-len", "128",
         "--input-len", "16", "--output-len", "4", "--num-requests", "30",
         "--max-concurrency", "1", "--no-progress"]  # fmt: skip


def hit_rate(ray_url: str, llama_dir: Path, router: str, output: Path) -> float:
    engine, options = server_args(llama_dir, num_pages=NUM_PAGES, max_model_len=256)
    deploy = DeployOptions(replicas=2, router=router)
    serve.run(build_app(engine, options, deploy, router), name=router)
    try:
        argv = ["bench", "serve", "--base-url", ray_url, "--model", MODEL_NAME, *BENCH]
        assert main([*argv, "--output", str(output)]) == 0
    finally:
        shutdown_app(router)
    report = json.loads(output.read_text())
    assert report["failed"] == 0
    return report["prefix_cache_hit_rate"]


def test_prefix_routing_at_least_doubles_the_cache_hit_rate_of_round_robin(
    ray_url: str, llama_dir: Path, tmp_path: Path
) -> None:
    prefix = hit_rate(ray_url, llama_dir, "prefix", tmp_path / "prefix.json")
    round_robin = hit_rate(ray_url, llama_dir, "round-robin", tmp_path / "round-robin.json")
    print(f"prefix cache hit rate: cache-aware {prefix:.1%}, round-robin {round_robin:.1%}")
    assert prefix >= 2 * round_robin and prefix > 0.5, (prefix, round_robin)
