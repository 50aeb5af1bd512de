"""Images of every mode and shape a client may send, through a tokenizer worker: each is either
preprocessed as transformers' image processor would see it, or refused with a 400 naming
`messages` and the image, never a 500 or a dead worker."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from PIL import Image

from tests.multimodal.conftest import png_bytes, random_image
from tokenmill.config import EngineArgs
from tokenmill.intake import ContextLimits
from tokenmill.ipc.messages import EngineRequest, RequestError, TokenizeRequest
from tokenmill.ipc.sockets import encode
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenization.tokenizer import load_tokenizer
from tokenmill.tokenization.tokenizer_worker import TokenizerWorker
from tokenmill.vision.images import ImagePreprocessor, image_setup
from tokenmill.vision.inputs import ImageInput


@pytest.fixture(scope="module")
def worker(vl_checkpoints: dict[str, Path]) -> TokenizerWorker:
    path = vl_checkpoints["qwen3_vl"]
    setup = image_setup(EngineArgs(model=str(path), device="cpu").create_served_model())
    assert setup is not None
    return TokenizerWorker(
        load_tokenizer(str(path)), ContextLimits(600, 4096, None), ImagePreprocessor(setup)
    )


def _encoded(image: Image.Image, fmt: str = "PNG", **options: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def _handle(worker: TokenizerWorker, *images: bytes) -> tuple[list[bytes], RequestError | None]:
    urls = [f"data:image/png;base64,{base64.b64encode(data).decode()}" for data in images]
    return _handle_urls(worker, urls)


def _handle_urls(
    worker: TokenizerWorker, urls: list[str]
) -> tuple[list[bytes], RequestError | None]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}]
    request = TokenizeRequest("r", SamplingParams(max_tokens=2), messages=messages)
    return worker.handle(encode(request))


def _refusal(worker: TokenizerWorker, *images: bytes) -> str:
    """The message of the 400 naming `messages` that `images` get."""
    encoded, error = _handle(worker, *images)
    assert encoded == [] and error is not None
    assert (error.status, error.param) == (400, "messages"), error
    return error.message


def _preprocessed(worker: TokenizerWorker, *images: bytes) -> tuple[ImageInput, ...]:
    (encoded,), error = _handle(worker, *images)
    assert error is None, error
    request = msgspec.msgpack.decode(encoded, type=EngineRequest)
    return tuple(payload.image() for payload in request.images)


def _reference(worker: TokenizerWorker, image: Image.Image) -> np.ndarray:
    """transformers' pixel values of `image`, given to its image processor as it is."""
    assert worker.images is not None
    return worker.images.processor(images=[image], return_tensors="np")["pixel_values"]


def test_an_aspect_ratio_over_200_is_a_400_naming_the_image(worker: TokenizerWorker) -> None:
    fine, wide = png_bytes(random_image(32, 32, seed=1)), png_bytes(random_image(402, 2, seed=2))
    message = _refusal(worker, fine, wide)
    assert message.startswith("messages: image 1 (402x2): ") and "aspect ratio" in message


def _transparent(mode: str) -> Image.Image:
    """Red, its left half transparent, in `mode` (a palette's transparency: its entry 0)."""
    if mode == "P":
        image = Image.new("P", (16, 16), 0)
        image.putpalette([0, 0, 0, 255, 0, 0])
        image.paste(1, (8, 0, 16, 16))
        return image
    rgba = np.zeros((16, 16, 4), np.uint8)
    rgba[..., 0] = 255
    rgba[:, 8:, 3] = 255
    return Image.fromarray(rgba).convert(mode)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_on_white_as_transformers_does(
    worker: TokenizerWorker, mode: str
) -> None:
    image = _transparent(mode)
    options = {"transparency": 0} if mode == "P" else {}
    data = _encoded(image, **options)
    (preprocessed,) = _preprocessed(worker, data)
    reference = _reference(worker, Image.open(io.BytesIO(data)))
    # transformers composites it on white; PIL's convert("RGB") showed what the transparent
    # half hides (black for RGBA, dark gray for LA; for P it keeps the transparent colour,
    # which transformers then composites).
    np.testing.assert_array_equal(preprocessed.pixel_values, reference)


def test_a_16_bit_grayscale_image_keeps_its_shades(worker: TokenizerWorker) -> None:
    shades = np.random.default_rng(3).integers(0, 256, (24, 32), dtype=np.uint8)
    sixteen = Image.fromarray(shades.astype(np.uint16) * 257)  # 0x00..0xFFFF, mode I;16
    assert sixteen.mode == "I;16"
    (preprocessed,) = _preprocessed(worker, _encoded(sixteen))
    # PIL's convert("RGB") clipped every value over 255: an image almost all white.
    reference = _reference(worker, Image.fromarray(shades).convert("RGB"))
    np.testing.assert_array_equal(preprocessed.pixel_values, reference)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "TIFF"])
def test_an_exif_orientation_is_applied_as_a_viewer_shows_it(
    worker: TokenizerWorker, fmt: str
) -> None:
    stored = random_image(48, 16, seed=4)
    exif = stored.getexif()
    exif[0x0112] = 6  # Orientation: shown turned 90 degrees clockwise
    options = {"lossless": True} if fmt == "WEBP" else {}
    (preprocessed,) = _preprocessed(worker, _encoded(stored, fmt, exif=exif, **options))
    shown = stored.transpose(Image.Transpose.ROTATE_270)  # 16 wide, 48 high
    np.testing.assert_array_equal(preprocessed.pixel_values, _reference(worker, shown))
    assert preprocessed.grid_thw[1] > preprocessed.grid_thw[2]  # taller than wide


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n{ } loop\n"  # Ghostscript: forever


@pytest.mark.parametrize("data", [EPS, b"P6\n2 2\n255\n" + bytes(12)], ids=["EPS", "PPM"])
def test_a_format_outside_the_read_ones_is_a_400_naming_them(
    worker: TokenizerWorker, data: bytes
) -> None:
    message = _refusal(worker, data)
    assert message == (
        "messages: image 0 is not an image this server reads "
        "(PNG, JPEG, WEBP, GIF, BMP, TIFF, AVIF)"
    )


def test_a_corrupt_avif_is_a_400(worker: TokenizerWorker) -> None:
    data = bytearray(_encoded(random_image(40, 24, seed=5), "AVIF"))
    data[81] ^= 0xFF  # its decoder raises RuntimeError("Missing or empty image item")
    assert _refusal(worker, bytes(data)).startswith("messages: image 0 could not be decoded: ")


def test_a_data_url_in_capitals_is_read_as_one(worker: TokenizerWorker) -> None:
    data = png_bytes(random_image(32, 32, seed=6))
    url = f"DATA:IMAGE/PNG;BASE64,{base64.b64encode(data).decode()}"  # RFC 2397: case-blind
    (encoded,), error = _handle_urls(worker, [url])
    assert error is None, error
    (image,) = msgspec.msgpack.decode(encoded, type=EngineRequest).images
    assert image.image().key == _preprocessed(worker, data)[0].key


# Peak memory of preprocessing eight 4096x4096 images (the default --max-image-pixels), in a
# fresh process: what the worker holds beyond the one PNG it was given, in KiB.
_PEAK_SCRIPT = """
import io, resource, sys
from PIL import Image
from tokenmill.config import EngineArgs
from tokenmill.vision.images import ImagePreprocessor, image_setup
served = EngineArgs(model=sys.argv[1], device="cpu").create_served_model()
images = ImagePreprocessor(image_setup(served))
buf = io.BytesIO()
Image.new("RGB", (4096, 4096)).save(buf, format="PNG")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
images.expand([images.vision.image_token_id] * 8, [buf.getvalue()] * 8)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_a_requests_images_are_decoded_one_at_a_time(vl_checkpoints: dict[str, Path]) -> None:
    # All eight held decoded at once took 680 MB of a tokenizer worker for one request.
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(vl_checkpoints["qwen3_vl"])],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    decoded_mib = 8 * 4096 * 4096 * 3 / 2**20  # 384 MiB of RGB pixels
    assert int(run.stdout) / 1024 < decoded_mib, run.stdout  # 160 MiB; 625 held together
