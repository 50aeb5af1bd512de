"""Structured outputs on a CUDA GPU: the bitmask applied by xgrammar's kernel inside CUDA-graph
decode steps with overlap scheduling; outputs validate and greedy tokens equal the CPU engine's."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.structured.schemas import SCHEMAS
from tokenmill import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_outputs_validate_on_the_gpu(llama_dir: Path, dtype: str) -> None:
    llm = LLM(str(llama_dir), device="cuda", dtype=dtype, max_model_len=512)
    for name, schema in SCHEMAS.items():
        constraint = StructuredOutputsParams(json=schema)
        params = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=constraint)
            for s in range(32)
        ]
        for out in llm.generate(["Hello"] * 32, params, use_tqdm=False):
            assert out.outputs[0].finish_reason == "stop", (name, out.outputs[0].text)
            jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_greedy_constrained_tokens_equal_the_cpu_engine(llama_dir: Path) -> None:
    constraint = StructuredOutputsParams(json=SCHEMAS["refs"])
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=constraint)
    prompts = ["Hello", "The cat", [5, 6, 7]]
    gpu = LLM(str(llama_dir), device="cuda", dtype="float32").generate(
        prompts, params, use_tqdm=False
    )
    cpu = LLM(str(llama_dir), device="cpu", dtype="float32").generate(
        prompts, params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]


def test_a_vocabulary_padded_past_the_tokenizer_on_the_gpu(tmp_path: Path, llama_dir: Path) -> None:
    """The mask covers the tokenizer; the padding ids are forbidden by the sampler on the
    device (inside CUDA-graph decode steps), so outputs validate and never use them."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] += 301
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), device="cuda", max_model_len=512, load_format="dummy")
    schema = SCHEMAS["nested_object"]
    constraint = StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=constraint)
        for s in range(32)
    ]
    for out in llm.generate(["Hello"] * 32, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert max(out.outputs[0].token_ids) < config["vocab_size"] - 301


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_model_drafts_for_constrained_requests_on_the_gpu(
    llama_dir: Path, temperature: float
) -> None:
    """Drafts from the draft loop graph (greedy) or eager drafting (sampled), copied to the
    host behind the draft model for the masks past them: outputs parse, greedy tokens are
    plain decoding's."""
    constraint = StructuredOutputsParams(json=SCHEMAS["refs"])
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=300,
                             structured_outputs=constraint) for s in range(16)]  # fmt: skip
    speculative = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3,
                   "adaptive": False}  # fmt: skip
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", max_model_len=512,
              speculative_config=speculative)  # fmt: skip
    outputs = llm.generate(["Hello"] * 16, params, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["refs"])
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    if temperature == 0:
        plain = LLM(str(llama_dir), device="cuda", dtype="float32", max_model_len=512)
        expected = plain.generate(["Hello"] * 16, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [
            o.outputs[0].token_ids for o in expected
        ]
