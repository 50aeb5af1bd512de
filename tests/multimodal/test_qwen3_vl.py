"""Qwen3-VL and Qwen3-VL-MoE with images: greedy output equals transformers' token for token
(float32, CPU), with one image, several, and batched with text-only chats; prefix caching and
the encoder cache keyed on image content; multimodal positions through chunked prefill and
preemption; prompt logprobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_prompt_logprobs_match
from tests.multimodal.conftest import chat, hf_vl_greedy, hf_vl_logprobs, random_image
from tokenmill import LLM, SamplingParams
from tokenmill.testing.checkpoints import VL_FAMILIES
from tokenmill.tokenization.tokenizer import render_chat

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", seed=0, **kwargs)


def _reference(llm: LLM, path: Path, conversation: list[dict[str, Any]]) -> list[int]:
    ids, images = render_chat(llm.tokenizer, conversation, llm.images)
    return hf_vl_greedy(path, ids, images, GREEDY.max_tokens)


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_greedy_matches_transformers_with_images_batched_with_text(
    vl_checkpoints: dict[str, Path], family: str
) -> None:
    path = vl_checkpoints[family]
    llm = _llm(path)
    conversations = [
        chat("Describe it.", random_image(40, 56, seed=1)),
        chat("Compare them.", random_image(32, 32, seed=2), random_image(64, 32, seed=3)),
        [{"role": "user", "content": "Hello world! How are you today?"}],
    ]
    outputs = llm.chat(conversations, GREEDY)
    for conversation, out in zip(conversations, outputs, strict=True):
        assert out.outputs[0].token_ids == _reference(llm, path, conversation)
    # The image prompts really hold expanded placeholders (4 tokens per 32x32 image).
    image_token = llm.config.model.vision.image_token_id
    assert outputs[1].prompt_token_ids.count(image_token) == 4 + 8
    assert image_token not in outputs[2].prompt_token_ids


def test_hub_transposed_expert_layout_loads(
    vl_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The hub's Qwen3-VL-MoE checkpoints hold the stacked experts transposed ([E, H, 2I],
    [E, I, H]); loading them gives the same model."""
    source = vl_checkpoints["qwen3_vl_moe"]
    hub = tmp_path / "hub"
    hub.mkdir()
    for f in source.iterdir():
        (hub / f.name).write_bytes(f.read_bytes())
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    conversation = chat("Describe it.", random_image(48, 32, seed=4))
    expected = _llm(source).chat(conversation, GREEDY)[0].outputs[0].token_ids
    assert _llm(hub).chat(conversation, GREEDY)[0].outputs[0].token_ids == expected


def test_repeated_image_hits_the_prefix_cache_and_a_different_one_does_not(
    vl_checkpoints: dict[str, Path],
) -> None:
    path = vl_checkpoints["qwen3_vl"]
    llm = _llm(path, page_size=4)
    first, same, other = (random_image(64, 64, seed=s) for s in (5, 5, 6))
    llm.chat(chat("What is it?", first), GREEDY)
    encoded = llm.engine.runner.encoder_cache.stats.images_encoded
    again = llm.chat(chat("What is it?", same), GREEDY)[0]
    ids, _ = render_chat(llm.tokenizer, chat("What is it?", same), llm.images)
    image_token = llm.config.model.vision.image_token_id
    image_end = len(ids) - ids[::-1].index(image_token)
    assert again.num_cached_tokens >= image_end - image_end % 4  # the image's pages shared
    assert llm.engine.runner.encoder_cache.stats.images_encoded == encoded  # not re-encoded
    different = llm.chat(chat("What is it?", other), GREEDY)[0]
    assert different.num_cached_tokens <= ids.index(image_token)  # same size, no image pages
    path_ref = _reference(llm, path, chat("What is it?", other))
    assert different.outputs[0].token_ids == path_ref
    assert again.outputs[0].token_ids == _reference(llm, path, chat("What is it?", first))


def test_chunked_prefill_and_preemption_keep_multimodal_positions(
    vl_checkpoints: dict[str, Path],
) -> None:
    """Chunks of 5 tokens split images mid-way; a KV cache of few pages preempts requests,
    which recompute their prompts (images included) later."""
    path = vl_checkpoints["qwen3_vl_moe"]
    conversations = [
        chat(f"Picture {i}, please describe.", random_image(64, 48, seed=10 + i)) for i in range(3)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = _llm(path, page_size=4, max_num_batched_tokens=5, num_pages=24, max_model_len=64,
               encoder_cache_tokens=0)  # fmt: skip
    outputs = llm.chat(conversations, params)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for conversation, out in zip(conversations, outputs, strict=True):
        ids, images = render_chat(llm.tokenizer, conversation, llm.images)
        assert out.outputs[0].token_ids == hf_vl_greedy(path, ids, images, 12)


def test_prompt_logprobs_with_an_image_match_transformers(vl_checkpoints: dict[str, Path]) -> None:
    """Every prompt position is scored, the image's placeholders and the text after them
    alike, through chunks that split the image."""
    path = vl_checkpoints["qwen3_vl"]
    llm = _llm(path, page_size=4, max_num_batched_tokens=8)
    conversation = chat("Describe it.", random_image(48, 32, seed=8))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    out = llm.chat(conversation, params)[0]
    ids, images = render_chat(llm.tokenizer, conversation, llm.images)
    reference = hf_vl_logprobs(path, ids, images)
    assert_prompt_logprobs_match(out.prompt_logprobs, reference, ids)


def test_tensor_parallel_ranks_answer_like_transformers(vl_checkpoints: dict[str, Path]) -> None:
    """Two CPU ranks (gloo): the decoder and experts split, the vision encoder on both."""
    threads = torch.get_num_threads()
    path = vl_checkpoints["qwen3_vl_moe"]
    try:
        llm = _llm(path, tensor_parallel_size=2)
        conversation = chat("Describe it.", random_image(48, 32, seed=7))
        out = llm.chat(conversation, GREEDY)[0]
        llm.close()
    finally:
        torch.set_num_threads(threads)  # rank 0 took its share of the cores
    assert out.outputs[0].token_ids == _reference(_llm(path), path, conversation)
