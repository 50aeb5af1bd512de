"""Qwen3-VL and Qwen3-VL-MoE on a CUDA GPU (Triton attention, CUDA graphs for the text
steps, the vision encoder inside the engine step): greedy equality with transformers in
float32 for image chats batched with text chats, with and without graphs and with chunked
prefill; a repeated image hits the prefix and encoder caches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multimodal.conftest import chat, hf_vl_greedy, random_image
from tokenmill import LLM, SamplingParams
from tokenmill.testing.checkpoints import VL_FAMILIES, build_vl_checkpoint
from tokenmill.tokenization.tokenizer import render_chat

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SETTINGS = {
    "cuda_graphs": {},
    "eager": {"enforce_eager": True},
    "chunked_prefill": {"max_num_batched_tokens": 7},
}
CONVERSATIONS = [
    chat("Describe it.", random_image(64, 48, seed=1)),
    chat("Compare them.", random_image(32, 32, seed=2), random_image(64, 64, seed=3)),
    [{"role": "user", "content": "Hello world! How are you today?"}],
    chat("And this one?", random_image(48, 64, seed=4)),
]


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl-gpu")
    return {family: build_vl_checkpoint(root / family, family) for family in VL_FAMILIES}


@pytest.mark.parametrize("family", VL_FAMILIES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_image_chats_match_transformers_on_gpu(
    vl_dirs: dict[str, Path], family: str, setting: str
) -> None:
    path = vl_dirs[family]
    llm = LLM(str(path), dtype="float32", device="cuda", page_size=4, **SETTINGS[setting])
    outputs = llm.chat(CONVERSATIONS, GREEDY)
    for conversation, out in zip(CONVERSATIONS, outputs, strict=True):
        ids, images = render_chat(llm.tokenizer, conversation, llm.images)
        assert out.outputs[0].token_ids == hf_vl_greedy(path, ids, images, MAX_TOKENS)


def test_repeated_image_is_served_from_the_caches_on_gpu(vl_dirs: dict[str, Path]) -> None:
    llm = LLM(str(vl_dirs["qwen3_vl_moe"]), dtype="float32", device="cuda", page_size=4)
    conversation = chat("Describe it.", random_image(64, 64, seed=9))
    first = llm.chat(conversation, GREEDY)[0]
    again = llm.chat(conversation, GREEDY)[0]
    assert again.num_cached_tokens > len(first.prompt_token_ids) // 2
    assert llm.engine.runner.encoder_cache.stats.images_encoded == 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
