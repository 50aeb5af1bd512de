"""The pieces of the start-up benchmark (benchmarks/startup.py): reading the server's phases,
pointing every cache at one folder, and the B6 / data FLOPs it reports beside."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.roofline import ModelCost
from tokenmill.bench.server_process import (
    cache_environment,
    cache_files,
    drop_from_page_cache,
    startup_log_line,
    startup_phases,
)
from tokenmill.config import ModelConfig
from tokenmill.observability.metrics import ServerMetrics
from tokenmill.observability.startup import StartupTimer
from tokenmill.tuning_cache import default_tuning_cache_dir

DATA = Path(__file__).parents[1] / "data"


def test_phases_read_back_from_the_servers_metrics_page_in_order() -> None:
    metrics = ServerMetrics('a "quoted" model', trace_file=None, log_requests=False)
    phases = {"server_imports": 2.5, "load_weights": 1.25, "cuda_graphs": 0.5, "other": 0.125}
    metrics.on_ready(phases)
    assert startup_phases(metrics.render().decode()) == phases


def test_startup_line_found_in_a_server_log() -> None:
    timer = StartupTimer()
    timer.add({"server_imports": 3.1, "load_weights": 12.0})
    log = f"INFO: started engine-core\n2026-12-01 INFO tokenmill.server: {timer.summary()}\nINFO"
    assert startup_log_line(log) == "start-up 15.10 s (server_imports 3.10 s, load_weights 12.00 s)"
    assert startup_log_line("INFO: no start-up line") is None


def test_cache_environment_moves_the_default_tuning_cache_under_its_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = cache_environment(tmp_path)
    assert all(Path(value).is_relative_to(tmp_path) for value in env.values())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Path(default_tuning_cache_dir()).is_relative_to(tmp_path)


def test_cache_files_counts_the_tuning_cache_apart(tmp_path: Path) -> None:
    for name in ("tokenmill/tuning/H200/gemv-a.json", "tokenmill/tuning/H200/gemv-b.json",
                 "triton/abc/kernel.cubin", "triton/abc/kernel.json"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    assert cache_files(tmp_path) == {"triton": 2, "tuning": 2}


def test_dropping_a_checkpoint_from_the_page_cache_keeps_its_files(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 5000)
    (tmp_path / "config.json").write_text("{}")
    assert drop_from_page_cache(tmp_path) == 5002
    assert (tmp_path / "model.safetensors").read_bytes() == b"x" * 5000


def test_b6_flops_count_the_layers_per_token_causal_attention_and_one_lm_head() -> None:
    """BENCHMARKS.md B6: 2 x non-embedding parameters per token plus causal attention (QK and
    PV, 2 x 2 FLOPs per head dimension, layer and context token); the LM head runs once."""
    cfg = ModelConfig.from_pretrained(DATA / "llama-3.1-8b")
    cost = ModelCost.of(cfg, 2)
    h, layers, heads, kv, d = 4096, 32, 32, 8, 128
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * 14336
    prompt = 8192
    expected = 2 * layers * per_layer * prompt
    expected += 4 * layers * heads * d * prompt * (prompt + 1) / 2
    expected += 2 * 128256 * h
    assert cost.sequence_flops(np.array([prompt]), np.array([1])) == pytest.approx(expected)


def test_sequence_flops_of_a_generation_are_those_of_its_tokens_run_as_one_prompt() -> None:
    """A prompt of 100 tokens and 20 outputs runs 119 tokens through the layers (the last
    output is never fed back) and the LM head 20 times."""
    cost = ModelCost.of(ModelConfig.from_pretrained(DATA / "llama-3.1-8b"), 2)
    generated = cost.sequence_flops(np.array([100, 50]), np.array([20, 1]))
    as_prompts = cost.sequence_flops(np.array([119, 50]), np.array([1, 1]))
    assert generated == pytest.approx(as_prompts + 19 * cost.logits_flops)
