"""The host side of images: tokenizer-worker preprocessing and placeholder expansion, raw-byte
payloads to the engine core, multimodal rotary positions (against transformers'
`get_rope_index`), image-keyed prefix-cache keys, and one encoder pass per step."""

from __future__ import annotations

import base64
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq
from PIL import Image

from tests.multimodal.conftest import chat, hf_vl_greedy, png_bytes, random_image
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.intake import ContextLimits
from tokenmill.ipc.messages import AbortRequest, EngineRequest, TokenizeRequest
from tokenmill.ipc.sockets import encode, pull, push
from tokenmill.tokenization.tokenizer import load_tokenizer, render_chat
from tokenmill.tokenization.tokenizer_worker import Inbox, TokenizerWorker
from tokenmill.vision.images import ImagePreprocessor, image_setup
from tokenmill.vision.inputs import ImageInput, MultimodalPrompt


@pytest.fixture(scope="module")
def vl_dir(vl_checkpoints: dict[str, Path]) -> Path:
    return vl_checkpoints["qwen3_vl"]


def _preprocessor(path: Path) -> ImagePreprocessor:
    setup = image_setup(EngineArgs(model=str(path), device="cpu").create_served_model())
    assert setup is not None
    return ImagePreprocessor(setup)


def test_tokenizer_worker_ships_expanded_prompt_and_raw_pixels(vl_dir: Path) -> None:
    images = _preprocessor(vl_dir)
    worker = TokenizerWorker(load_tokenizer(str(vl_dir)), ContextLimits(600, 1024, None), images)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(random_image(64, 32, 1))).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}},
    ]}]  # fmt: skip
    raw = encode(TokenizeRequest("r1", SamplingParams(max_tokens=2), messages=messages))
    (encoded,), error = worker.handle(raw)
    assert error is None
    req = msgspec.msgpack.decode(encoded, type=EngineRequest)
    (payload,) = req.images
    image = payload.image()
    # 64x32 pixels are 8x4 patches of 8, merged 2x2: 8 tokens, filling the placeholders.
    assert image.grid_thw == (1, 4, 8) and image.num_tokens == 8
    token = images.vision.image_token_id
    assert req.prompt_token_ids[image.offset : image.end] == [token] * 8
    assert req.prompt_token_ids.count(token) == 8
    # Raw bytes on the wire (4 bytes a value, not a msgpack float list) and a view out.
    assert len(encoded) < image.pixel_values.nbytes + 2000
    assert not image.pixel_values.flags.owndata
    expected = images.processor(images=[random_image(64, 32, 1)], return_tensors="np")
    np.testing.assert_array_equal(image.pixel_values, expected["pixel_values"])


def test_mrope_positions_match_transformers(vl_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    grids = [(1, 4, 8), (1, 6, 2), (1, 2, 2)]
    ids, images = [3, 4], []
    for n, grid in enumerate(grids):
        count = grid[1] * grid[2] // 4
        images.append(ImageInput(n, np.zeros((1, 1), np.float32), grid, len(ids), count))
        ids += [hf.config.image_token_id] * count + [5] * (n + 1)
    mm = MultimodalPrompt.build(len(ids), tuple(images), 2)
    t = torch.tensor([ids])
    positions, delta = hf.model.get_rope_index(
        t, (t == hf.config.image_token_id).int(), torch.tensor(grids)
    )
    np.testing.assert_array_equal(mm.positions, positions[:, 0].numpy())
    assert mm.rope_delta == int(delta)
    after = mm.rope_positions(len(ids) - 1, len(ids) + 2)
    np.testing.assert_array_equal(
        after[:, 1:], np.broadcast_to(np.arange(2) + len(ids) + mm.rope_delta, (3, 2))
    )


def test_cache_keys_name_the_image_not_its_placeholder() -> None:
    pixels = np.zeros((4, 1), np.float32)
    a = ImageInput(11, pixels, (1, 2, 2), 2, 1)
    b = ImageInput(12, pixels, (1, 2, 2), 2, 1)
    ids = [1, 2, 9, 3]
    keys_a = MultimodalPrompt.build(4, (a,), 2).cache_keys(ids)
    keys_b = MultimodalPrompt.build(4, (b,), 2).cache_keys(ids)
    assert keys_a[:2] == keys_b[:2] == [1, 2] and keys_a[3] == keys_b[3] == 3
    assert keys_a[2] != keys_b[2] and keys_a[2] < 0


def test_a_steps_images_are_encoded_in_one_pass(vl_dir: Path) -> None:
    llm = LLM(str(vl_dir), dtype="float32", device="cpu")
    runner = llm.engine.runner
    calls: list[int] = []
    encode_images = runner.encoder_cache.encoder

    def counting(patches: torch.Tensor, grids: list) -> list:
        calls.append(len(grids))
        return encode_images(patches, grids)

    runner.encoder_cache.encoder = counting
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.chat([chat("one", random_image(32, 32, 1)), chat("two", random_image(32, 32, 2))], params)
    assert calls == [2]
    llm.chat([chat("again", random_image(32, 32, 2))], params)
    assert calls == [2] and runner.encoder_cache.stats.cache_hits == 1


def test_same_bytes_in_another_shape_is_another_image(vl_dir: Path) -> None:
    """34x32 and 32x34 pixels of the same bytes resize to one grid of patches: still two
    images, neither served the other's encoder outputs or KV pages."""
    flat = np.random.default_rng(0).integers(0, 256, 32 * 34 * 3, dtype=np.uint8)
    wide, tall = (Image.fromarray(flat.reshape(shape)) for shape in ((32, 34, 3), (34, 32, 3)))
    llm = LLM(str(vl_dir), dtype="float32", device="cpu", seed=0, page_size=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.chat(chat("Describe.", wide), params)
    out = llm.chat(chat("Describe.", tall), params)[0]
    ids, images = render_chat(llm.tokenizer, chat("Describe.", tall), llm.images)
    assert images[0].grid_thw == (1, 4, 4)  # as the wide one's
    assert llm.engine.runner.encoder_cache.stats.images_encoded == 2
    assert out.outputs[0].token_ids == hf_vl_greedy(vl_dir, ids, images, 6)


def test_a_request_ended_while_its_images_are_read_is_dropped_between_images(
    vl_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker asks before each image whether the api server ended the request (its client
    gone); it then stops reading and sends nothing (eight 16-megapixel images had held it)."""
    images = _preprocessor(vl_dir)
    worker = TokenizerWorker(load_tokenizer(str(vl_dir)), ContextLimits(600, 1024, None), images)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(random_image(64, 32, 1))).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    messages = [{"role": "user", "content": [part, part, part]}]
    raw = encode(TokenizeRequest("r1", SamplingParams(max_tokens=2), messages=messages))
    read = []
    original = images._read
    monkeypatch.setattr(images, "_read", lambda source, n: read.append(n) or original(source, n))
    asked = []
    assert worker.handle(raw, lambda rid: asked.append(rid) or len(asked) > 1) == ([], None)
    assert read == [0] and asked == ["r1", "r1"]
    (_encoded,), error = worker.handle(raw)  # not ended: all three
    assert error is None and read == [0, 0, 1, 2]


def test_the_inbox_tells_the_request_in_hand_ended_and_what_it_dropped() -> None:
    ctx = zmq.Context()
    address = f"ipc://{tempfile.mkdtemp()}/inbox"
    inbox = Inbox(pull(ctx, address, bind=True))
    sender = push(ctx, address, bind=False)
    try:
        for rid in ("a", "b", "c"):
            sender.send(encode(TokenizeRequest(rid, SamplingParams(max_tokens=1), prompt="x")))
        assert msgspec.msgpack.decode(inbox.next(), type=TokenizeRequest).request_id == "a"
        assert not inbox.ended("a")
        # The api server names the ended requests' choices: "a" in hand, "b" still queued.
        sender.send(encode(AbortRequest(["a:0", "a:1", "b:0"])))
        deadline = time.monotonic() + 5
        while not inbox.ended("a") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inbox.ended("a")
        # Both are reported to the engine once: "b" dropped, "a" no longer read on.
        assert sorted(inbox.take_dropped()) == ["a:0", "a:1", "b:0"]
        assert inbox.take_dropped() == []
        assert msgspec.msgpack.decode(inbox.next(), type=TokenizeRequest).request_id == "c"
        assert not inbox.ended("a") and not inbox.ended("c")  # forgotten with the next request
    finally:
        ctx.destroy(linger=0)
