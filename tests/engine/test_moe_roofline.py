"""The roofline of a mixture of experts counts the experts a step's tokens are expected to touch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.roofline import (
    H200_COPY_BANDWIDTH,
    H200_MATMUL_FLOPS,
    Hardware,
    ModelCost,
    expected_experts_touched,
    single_stream_floor,
)
from tokenmill.config import ModelConfig

DATA = Path(__file__).parents[1] / "data"
H200 = Hardware(H200_COPY_BANDWIDTH, H200_MATMUL_FLOPS)


def test_expected_experts_touched() -> None:
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(128, 8, 2) == pytest.approx(8 + 8 * (1 - 8 / 128))
    assert expected_experts_touched(128, 8, 10_000) == pytest.approx(128)
    assert expected_experts_touched(8, 8, 1) == pytest.approx(8)  # every expert, every token


def test_qwen3_30b_a3b_reads_its_active_weights_per_token() -> None:
    """One token reads 8 of 128 experts in each of 48 layers: 3.0 B of the 30.5 B parameters."""
    cost = ModelCost.of(ModelConfig.from_pretrained(DATA / "qwen3-30b-a3b"), 2)
    expert = 3 * 2048 * 768 * 2  # bytes of one expert's three projections
    assert cost.expert_bytes == 48 * expert
    assert cost.weight_bytes(1) == pytest.approx(cost.dense_weight_bytes + 8 * 48 * expert)
    assert cost.weight_bytes(1) / 2 == pytest.approx(3.04e9, rel=0.01)
    assert cost.weight_bytes(100_000) / 2 == pytest.approx(30.5e9, rel=0.01)
    # Per token, the FLOPs of the active parameters only.
    assert cost.flops_per_token / 2 == pytest.approx(3.04e9, rel=0.01)
    sizes = [1, 2, 8, 64, 256]
    reads = [cost.weight_bytes(b) for b in sizes]
    assert reads == sorted(reads)
    # B1 floor: ~6.1 GB per token at 4.27 TB/s.
    floor = single_stream_floor(cost, 512, 256, H200)
    assert 1 / floor == pytest.approx(695, rel=0.02)


def test_dense_model_reads_every_weight_at_any_batch() -> None:
    cost = ModelCost.of(ModelConfig.from_pretrained(DATA / "llama-3.1-8b"), 2)
    assert cost.expert_bytes == 0
    assert cost.weight_bytes(1) == cost.weight_bytes(256) == cost.dense_weight_bytes
    step = cost.decode_step_time(np.array([100, 200]), H200)
    assert step == pytest.approx(
        (cost.dense_weight_bytes + 300 * cost.kv_bytes_per_token) / H200.bandwidth
    )


def test_bench_offline_runs_a_moe_config_with_dummy_weights(tmp_path: Path, capsys) -> None:
    """`tokenmill bench offline` on a mixture-of-experts config.json alone (dummy weights), with
    the transformers peer built from the same config."""
    import json

    from tokenmill.entrypoints.cli import main

    config = json.loads((DATA / "qwen3-30b-a3b" / "config.json").read_text())
    small = {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 96,
             "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 512, "mlp_only_layers": [1]}  # fmt: skip
    (tmp_path / "tiny-moe").mkdir()
    (tmp_path / "tiny-moe" / "config.json").write_text(json.dumps(config | small))
    report = tmp_path / "b1.json"
    args = ["bench", "offline", "--config", str(tmp_path / "tiny-moe"), "--workload", "b1",
            "--dtype", "float32", "--device", "cpu", "--input-len", "16", "--output-len", "8",
            "--output", str(report)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(report.read_text())
    assert result["tokenmill"]["output_tok_s"] > 0
    assert result["transformers"]["output_tok_s"] > 0
    assert "B1 tiny-moe" in capsys.readouterr().out


def test_shared_expert_is_read_at_every_step(tmp_path: Path) -> None:
    import json

    config = json.loads((DATA / "qwen3-30b-a3b" / "config.json").read_text())
    (tmp_path / "shared").mkdir()
    with_shared = config | {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                            "shared_expert_intermediate_size": 1024}  # fmt: skip
    (tmp_path / "shared" / "config.json").write_text(json.dumps(with_shared))
    base = ModelCost.of(ModelConfig.from_pretrained(DATA / "qwen3-30b-a3b"), 2)
    cost = ModelCost.of(ModelConfig.from_pretrained(tmp_path / "shared"), 2)
    shared_bytes = 48 * (3 * 2048 * 1024 + 2048) * 2
    # Qwen2-MoE's q/k/v bias and missing q/k norms change the dense bytes a little, too.
    assert cost.dense_weight_bytes - base.dense_weight_bytes == pytest.approx(
        shared_bytes, rel=0.01
    )
    assert cost.expert_bytes == base.expert_bytes
