"""From a chat's image parts to `ImageInput`s: read each image (a `data:` URL, bytes, a PIL
image, or, offline, a file path) within the limits, run the model's image processor
(transformers'), and expand each image's one placeholder token into as many as the image has
language-model tokens. Runs in the tokenizer workers (and in the offline `LLM`), never in the
engine core.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from tokenmill.vision.inputs import ImageInput, image_key, num_image_tokens

if TYPE_CHECKING:  # the tokenizer workers import this module; torch (via config) stays out
    from tokenmill.config import ImageLimits, ServedModel, VisionConfig

# What a chat's image part may hold: an OpenAI `image_url` string (a `data:` URL; offline also
# a file path), encoded bytes, or a decoded PIL image.
ImageSource = str | bytes | Path | Image.Image

# The formats read: what image APIs take, and no more of PIL's decoders than that (EPS would run
# Ghostscript on the client's PostScript; the rarer ones are attack surface nobody needs).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")

# What PIL raises for truncated or corrupt data (past `Image.open`'s own checks; AVIF's decoder
# raises RuntimeError).
_CORRUPT = (OSError, SyntaxError, ValueError, EOFError, RuntimeError)

# Content part types that carry an image, and the key holding it (OpenAI's and vLLM's forms).
_IMAGE_PARTS = {"image_url": "image_url", "image": "image", "image_pil": "image_pil"}


def split_images(
    messages: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """The messages with each image part replaced by `{"type": "image"}` (what chat templates
    render as the image's placeholder), and the images, in order."""
    rendered: list[dict[str, Any]] = []
    sources: list[ImageSource] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _IMAGE_PARTS:
                parts.append(part)
                continue
            value = _image_value(part)
            if not isinstance(value, str | bytes | Path | Image.Image):
                raise ValueError(f"messages: an {kind} part must hold an image, got {value!r:.80}")
            sources.append(value)
            parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, sources


def _image_value(part: dict[str, Any]) -> Any:
    """What an image part holds (OpenAI's `{"image_url": {"url": ...}}` unwrapped)."""
    value = part.get(_IMAGE_PARTS[part["type"]])
    return value.get("url") if isinstance(value, dict) else value


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | bytes) else None


def without_image_data(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image part's data replaced by its size (for logs: a `data:` URL
    is megabytes)."""
    shown = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {"type": p["type"], "size": _size(_image_value(p))}
                if isinstance(p, dict) and p.get("type") in _IMAGE_PARTS
                else p
                for p in content
            ]
            message = {**message, "content": content}
        shown.append(message)
    return shown


@dataclass(frozen=True)
class ImageSetup:
    """What a process needs to preprocess a model's images (picklable: the tokenizer workers
    get it): the folder holding its `preprocessor_config.json`, its vision config and the
    request limits."""

    processor_dir: str
    vision: VisionConfig
    limits: ImageLimits


def image_setup(model: ServedModel) -> ImageSetup | None:
    """The image preprocessing of the served `model` (None: a text-only model); its processor
    is read from the model's folder."""
    vision = model.vision
    return None if vision is None else ImageSetup(model.path, vision, model.images)


class RequestCancelled(Exception):
    """The request whose images were being read has ended (its client gone, or another of its
    prompts refused): nothing is to be sent for it."""


class ImagePreprocessor:
    """Turns a prompt's image sources into `ImageInput`s and its token ids into ones with
    every image's placeholders; errors are `ValueError`s naming `messages` and the image."""

    def __init__(self, setup: ImageSetup, allow_files: bool = False) -> None:
        from transformers import AutoImageProcessor  # its first import takes a second

        self.vision, self.limits, self.allow_files = setup.vision, setup.limits, allow_files
        with warnings.catch_warnings():  # "falling back to the PIL backend" without torchvision
            warnings.simplefilter("ignore")
            self.processor = AutoImageProcessor.from_pretrained(setup.processor_dir)
        ours = (setup.vision.patch_size, setup.vision.spatial_merge_size)
        theirs = (self.processor.patch_size, self.processor.merge_size)
        if ours != theirs:
            raise ValueError(
                f"the image processor's (patch_size, merge_size) {theirs} differ from the "
                f"model's vision_config {ours}"
            )

    def expand(
        self,
        token_ids: list[int],
        sources: Sequence[ImageSource],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """`token_ids` with each image placeholder token repeated for its image's tokens, and
        the images, preprocessed. `cancelled` is asked before each image: true, the request
        has ended (`RequestCancelled` is raised, the rest left unread)."""
        vision, limit = self.vision, self.limits.max_images_per_prompt
        if len(sources) > limit:
            raise ValueError(
                f"messages: {len(sources)} images, more than the {limit} a request may hold "
                "(--max-images-per-prompt)"
            )
        placeholders = [i for i, t in enumerate(token_ids) if t == vision.image_token_id]
        if len(placeholders) != len(sources):
            raise ValueError(
                f"messages: {len(sources)} images but the chat template wrote "
                f"{len(placeholders)} image placeholders"
            )
        if not sources:
            return token_ids, ()
        expanded: list[int] = []
        inputs: list[ImageInput] = []
        cursor = 0
        for n, (position, source) in enumerate(zip(placeholders, sources, strict=True)):
            if cancelled():
                raise RequestCancelled(f"cancelled before image {n} of {len(sources)}")
            key, patches, grid = self._read(source, n)
            num_tokens = num_image_tokens(grid, vision.spatial_merge_size)
            expanded += token_ids[cursor:position]
            inputs.append(ImageInput(key, patches, grid, len(expanded), num_tokens))
            expanded += [vision.image_token_id] * num_tokens
            cursor = position + 1
        expanded += token_ids[cursor:]
        return expanded, tuple(inputs)

    def _read(self, source: ImageSource, n: int) -> tuple[int, np.ndarray, tuple[int, int, int]]:
        """Image `n`'s key, patches and grid. One image is decoded at a time: a request's eight
        16-megapixel images held decoded together took 680 MB of a tokenizer worker."""
        image = self.open(source, n)
        patches, grid = self._preprocess(image, n)
        return image_key(np.asarray(image), grid), patches, grid

    def _preprocess(self, image: Image.Image, n: int) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Image `n`'s patches and grid, from the image processor (one image at a time, so that
        what it refuses, such as Qwen2-VL's aspect ratios over 200, is named by its image)."""
        try:
            out = self.processor(images=[image], return_tensors="np")
        except ValueError as exc:
            width, height = image.size
            raise ValueError(f"messages: image {n} ({width}x{height}): {exc}") from None
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return pixels, (t, h, w)

    def open(self, source: ImageSource, n: int) -> Image.Image:
        """Image `n` of a request, decoded, turned by its EXIF orientation (not a PIL image:
        that is taken as it is), in RGB, within the limits."""
        what = f"messages: image {n}"
        if isinstance(source, Image.Image):
            return rgb(self._checked(source, what))
        if isinstance(source, str) and source[:5].lower() == "data:":
            data = self._data_url(source, what)
        elif isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https"):
            raise ValueError(
                f"{what}: http(s) image URLs are not fetched (this server reads no network); "
                "send the image inline as a data: URL (data:image/png;base64,...)"
            )
        elif isinstance(source, bytes):
            data = source
        elif self.allow_files:
            data = self._file(Path(source), what)
        else:
            raise ValueError(f"{what}: image_url must be a data: URL, got {str(source)[:40]!r}")
        if len(data) > self.limits.max_image_bytes:
            raise ValueError(self._too_many_bytes(what, len(data)))
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
        except UnidentifiedImageError:
            formats = ", ".join(FORMATS)
            raise ValueError(f"{what} is not an image this server reads ({formats})") from None
        except Image.DecompressionBombError:
            raise ValueError(self._too_many_pixels(what, None)) from None
        except _CORRUPT as exc:  # a header cut short or corrupt (JPEG, WebP, ...)
            raise ValueError(f"{what} could not be decoded: {exc}") from None
        self._checked(image, what)  # the pixel count, before decoding them
        try:
            image.load()
            # Turned as a viewer shows it (phone cameras store photos sideways and say so).
            ImageOps.exif_transpose(image, in_place=True)
        except _CORRUPT as exc:  # truncated or corrupt data
            raise ValueError(f"{what} could not be decoded: {exc}") from None
        return rgb(image)

    def _data_url(self, url: str, what: str) -> bytes:
        header, sep, payload = url.partition(",")
        header = header.lower()  # the scheme, the media type and "base64" ignore case
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise ValueError(f"{what}: a data URL must be data:image/<type>;base64,<data>")
        if len(payload) * 3 // 4 > self.limits.max_image_bytes:
            raise ValueError(self._too_many_bytes(what, len(payload) * 3 // 4))
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{what}: the data URL is not valid base64") from None

    def _file(self, path: Path, what: str) -> bytes:
        if not path.is_file():
            raise ValueError(f"{what}: no such image file {str(path)!r}")
        if path.stat().st_size > self.limits.max_image_bytes:
            raise ValueError(self._too_many_bytes(what, path.stat().st_size))
        return path.read_bytes()

    def _checked(self, image: Image.Image, what: str) -> Image.Image:
        width, height = image.size
        if width * height > self.limits.max_image_pixels:
            raise ValueError(self._too_many_pixels(what, (width, height)))
        if min(width, height) < 1:
            raise ValueError(f"{what} is empty ({width}x{height})")
        return image

    def _too_many_bytes(self, what: str, size: int) -> str:
        limit = self.limits.max_image_bytes
        return f"{what} is {size} bytes, more than the {limit} allowed (--max-image-bytes)"

    def _too_many_pixels(self, what: str, size: tuple[int, int] | None) -> str:
        limit = self.limits.max_image_pixels
        shown = f" ({size[0]}x{size[1]})" if size else ""
        return f"{what} has more than {limit} pixels{shown} (--max-image-pixels)"


def rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB as transformers' image processors convert it (`convert_to_rgb`): what is
    transparent composited on white (PIL's `convert("RGB")` drops the alpha channel, showing
    what the transparent pixels hide, often black); a 16-bit grayscale image (`I;16`, `I;16B`,
    ...) as its values' top bytes (PIL's clips every value over 255: the image turned white)."""
    if image.mode.startswith("I;16"):
        image = Image.fromarray(_top_bytes(np.asarray(image)))
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def _top_bytes(values: np.ndarray) -> np.ndarray:
    """16-bit values as 8-bit ones."""
    return (values.astype(np.int64).clip(0, 65535) >> 8).astype(np.uint8)
