"""Qwen3-MoE (and Qwen2-MoE): greedy decoding equals transformers' token for token (float32, CPU)
under every engine setting, for each routing variant; the checkpoint's experts load into the
stacked weights (hub layout and transformers' fused layout); MoE config fields are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig, MoeConfig
from tokenmill.layers.moe import FusedMoE
from tokenmill.layers.sharding import MemoryTensor
from tokenmill.models.loader import load_model
from tokenmill.models.qwen3_moe import SparseMoeBlock
from tokenmill.testing.checkpoints import build_checkpoint

PROMPTS = [list(range(3, 10)), list(range(20, 77)), [100, 200, 300], [7] * 33 + [9], [42]]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

# The tiny family's defaults: 8 experts, top-2, norm_topk_prob, layer 1 of 3 dense
# (mlp_only_layers); the other variant: no renormalisation, every second layer sparse.
# Qwen2-MoE: a shared expert behind a sigmoid gate, layer 0 dense, no renormalisation.
VARIANTS = {
    "norm_topk_mlp_only_layer": ("qwen3_moe", {}),
    "no_norm_sparse_step_2": (
        "qwen3_moe",
        {
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [],
            "num_hidden_layers": 4,
        },
    ),
    "qwen2_moe_shared_expert": ("qwen2_moe", {}),
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        name: build_checkpoint(root / name, family, seed=i, **overrides)
        for i, (name, (family, overrides)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def moe_references(moe_checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {
        name: [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
        for name, path in moe_checkpoints.items()
    }


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_variants_build_the_layers_their_config_names(moe_checkpoints) -> None:
    """Sparse layers route to experts; mlp_only_layers and decoder_sparse_step keep dense MLPs."""
    sparse, shared = {}, {}
    for name, path in moe_checkpoints.items():
        llm = LLM(str(path), device="cpu")
        layers = llm.engine.runner.model.model.layers
        sparse[name] = [isinstance(layer.mlp, SparseMoeBlock) for layer in layers]
        shared[name] = any(getattr(layer.mlp, "shared_expert", None) for layer in layers)
    assert sparse == {
        "norm_topk_mlp_only_layer": [True, False, True],
        "no_norm_sparse_step_2": [False, True, False, True],
        "qwen2_moe_shared_expert": [False, True, True],
    }
    assert shared == {name: name.startswith("qwen2") for name in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_greedy_matches_transformers(variant, moe_checkpoints, moe_references) -> None:
    llm = LLM(str(moe_checkpoints[variant]), device="cpu")
    assert _greedy(llm) == moe_references[variant]


SETTINGS = {
    "chunked_prefill_budget_8": {"max_num_batched_tokens": 8},
    "no_overlap_scheduling": {"overlap_scheduling": False},
    "tiny_pool_preempts": {"page_size": 4, "num_pages": 24, "max_model_len": 96},
    "tiny_pool_chunked": {
        "page_size": 2,
        "num_pages": 48,
        "max_model_len": 96,
        "max_num_batched_tokens": 5,
    },
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("variant", ["norm_topk_mlp_only_layer", "qwen2_moe_shared_expert"])
def test_constrained_moe_engine_matches_transformers(
    variant, setting, moe_checkpoints, moe_references
) -> None:
    llm = LLM(str(moe_checkpoints[variant]), device="cpu", **SETTINGS[setting])
    assert _greedy(llm) == moe_references[variant]
    if "preempts" in setting:
        assert llm.engine.scheduler.stats.num_preemptions > 0


def test_prefix_cache_hits_keep_moe_outputs(moe_checkpoints, moe_references) -> None:
    variant = "no_norm_sparse_step_2"
    llm = LLM(str(moe_checkpoints[variant]), device="cpu", page_size=4)
    assert _greedy(llm) == moe_references[variant]
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == moe_references[variant]
    assert sum(o.num_cached_tokens for o in again) > 0


def test_fused_checkpoint_layout_loads_the_same_weights(tmp_path, moe_checkpoints) -> None:
    """transformers' in-memory layout (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj`)
    saved as is loads into the same parameters as the hub's per-expert tensors."""
    src = moe_checkpoints["norm_topk_mlp_only_layer"]
    tensors = load_file(src / "model.safetensors")
    fused = {name: t for name, t in tensors.items() if ".experts." not in name}
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp.experts"

        def expert(e: int, proj: str, prefix: str = prefix) -> torch.Tensor:
            return tensors[f"{prefix}.{e}.{proj}.weight"]

        gate_up = [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in range(8)]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack([expert(e, "down_proj") for e in range(8)])
    dst = tmp_path / "fused"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(fused, dst / "model.safetensors")
    cfg_a, cfg_b = ModelConfig.from_pretrained(src), ModelConfig.from_pretrained(dst)
    a = load_model(cfg_a, torch.device("cpu"), "auto", 0).state_dict()
    b = load_model(cfg_b, torch.device("cpu"), "auto", 0).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    experts = a["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(experts[3, 48:], tensors["model.layers.2.mlp.experts.3.up_proj.weight"])


def test_checkpoint_missing_one_expert_is_rejected(tmp_path, moe_checkpoints) -> None:
    src = moe_checkpoints["norm_topk_mlp_only_layer"]
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    dst = tmp_path / "missing"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj:up:5"):
        load_model(ModelConfig.from_pretrained(dst), torch.device("cpu"), "auto", 0)


def test_expert_shard_with_wrong_shape_is_rejected() -> None:
    layer = FusedMoE(4, hidden_size=8, intermediate_size=6, top_k=2, renormalize=True)
    with pytest.raises(ValueError, match="expected"):
        layer.weight_loader(layer.gate_up_proj, MemoryTensor(torch.zeros(7, 8)), "gate:1")
    with pytest.raises(ValueError, match="no expert shard"):
        layer.weight_loader(layer.down_proj, MemoryTensor(torch.zeros(8, 6)), "down:4")


def test_moe_config_reads_both_expert_count_names(tmp_path, moe_checkpoints) -> None:
    """transformers 5 writes `num_local_experts`, the hub's Qwen3-MoE configs `num_experts`."""
    path = moe_checkpoints["norm_topk_mlp_only_layer"]
    cfg = json.loads((path / "config.json").read_text())
    assert ModelConfig.from_pretrained(path).moe == MoeConfig(8, 2, 48, True, 1, (1,))
    hub = {k: v for k, v in cfg.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert MoeConfig.from_hf(hub) == MoeConfig(8, 2, 48, True, 1, (1,))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts": 0}, "num_experts must be >= 1"),
        ({"top_k": 9}, r"num_experts_per_tok must be in \[1, num_experts=8\]"),
        ({"intermediate_size": 0}, "moe_intermediate_size"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
        ({"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be >= 0"),
    ],
)
def test_bad_moe_config_is_rejected(fields: dict, message: str) -> None:
    base = {"num_experts": 8, "top_k": 2, "intermediate_size": 16}
    with pytest.raises(ValueError, match=message):
        MoeConfig(**(base | fields))


def test_sparse_layer_schedule() -> None:
    moe = MoeConfig(8, 2, 16, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
