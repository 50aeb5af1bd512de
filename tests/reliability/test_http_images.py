"""Chat completions with images over HTTP (a tiny Qwen3-VL server, the official `openai`
client): a `data:` URL image answers like the offline engine; bad images (http URL, truncated
bytes, not an image, too many bytes or pixels, too many images) are 400s in OpenAI's shape
naming `messages`, and the server keeps serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.e2e.server import MODEL_NAME, ServerHandle, run_server
from tests.multimodal.conftest import png_bytes, random_image
from tokenmill import LLM, SamplingParams

MAX_IMAGE_BYTES = 40_000
MAX_IMAGE_PIXELS = 100 * 100
MAX_IMAGES = 2


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenmill.testing.checkpoints import build_vl_checkpoint

    return build_vl_checkpoint(tmp_path_factory.mktemp("vl") / "qwen3_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def server(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    flags = [
        "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
        "--max-images-per-prompt", str(MAX_IMAGES), "--dtype", "float32",
    ]  # fmt: skip
    with run_server(vl_dir, log, *flags) as handle:
        yield handle


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _message(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}]


def test_image_chat_answers_like_the_offline_engine(server: ServerHandle, vl_dir: Path) -> None:
    image = random_image(48, 40, seed=1)
    url = _data_url(png_bytes(image))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=_message(url), max_tokens=5,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    offline = LLM(str(vl_dir), dtype="float32", device="cpu").chat(
        [{"role": "user", "content": [{"type": "image", "image": image},
                                      {"type": "text", "text": "Describe it."}]}], params,
    )[0]  # fmt: skip
    assert response.choices[0].message.content == offline.outputs[0].text
    assert response.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert url[-64:] not in server.log  # the request's log line names the image's size only
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    encoded = [line for line in metrics.splitlines() if "vision_encoder_images_total{" in line]
    assert encoded and float(encoded[0].split()[-1]) >= 1, metrics


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _bad_images() -> dict[str, list[str]]:
    png = png_bytes(random_image(32, 32, seed=2))
    jpeg = _encoded(random_image(32, 32, seed=4), "JPEG")
    webp = _encoded(random_image(32, 32, seed=5), "WEBP")
    return {
        "http URL": ["https://example.com/cat.png"],
        "truncated bytes": [_data_url(png[: len(png) // 2])],
        # Cut inside the header: PIL's Image.open raises OSError (not UnidentifiedImageError).
        "truncated JPEG header": [_data_url(jpeg[:100], mime="image/jpeg")],
        "truncated WebP header": [_data_url(webp[:60], mime="image/webp")],
        "not an image": [_data_url(b"just some text, not a picture")],
        "not image data": [_data_url(png, mime="text/plain")],
        "bad base64": ["data:image/png;base64,!!!notbase64!!!"],
        "too many bytes": [_data_url(b"\0" * (MAX_IMAGE_BYTES + 1))],
        "too many pixels": [_data_url(png_bytes(random_image(101, 100, seed=3)))],
        "too many images": [_data_url(png)] * (MAX_IMAGES + 1),
        "aspect ratio over 200": [_data_url(png_bytes(random_image(201, 1, seed=6)))],
    }


@pytest.mark.parametrize("case", list(_bad_images()))
def test_bad_image_is_400_naming_messages(server: ServerHandle, case: str) -> None:
    body = {"model": MODEL_NAME, "messages": _message(*_bad_images()[case]), "max_tokens": 2}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "messages", error
    assert "image" in error["message"]
    if case != "too many images":
        assert error["message"].startswith("messages: image 0"), error
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_malformed_image_part_is_400(server: ServerHandle) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": "not-an-object"}]}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("messages")


def test_image_placeholder_in_a_completion_prompt_is_400_naming_prompt(
    server: ServerHandle,
) -> None:
    body = {"model": MODEL_NAME, "prompt": "<|vision_start|><|image_pad|><|vision_end|> Hi"}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "image" in error["message"], error
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_text_only_model_refuses_images(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu")
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": random_image(8, 8, 0)}]}])
