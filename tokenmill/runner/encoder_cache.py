"""The vision encoder's outputs on the device, by image content: a step's images are encoded
together (one encoder pass for every image it needs that is not here), and an image seen
again (a later prefill chunk, a prefix-cache miss, another request) is not encoded again."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.models.qwen3_vl import EncodedImage, VisionEmbeds
from tokenmill.vision.inputs import ImageInput, StepImage

# Encodes images whose patches are concatenated, given their grids; one output per image.
Encoder = Callable[[torch.Tensor, list[tuple[int, int, int]]], list[EncodedImage]]


@dataclass
class EncoderStats:
    """Images encoded, images served from the cache, and host seconds spent in encoder calls
    (`EncoderCache.encoder_seconds` gives the device time on CUDA)."""

    images_encoded: int = 0
    cache_hits: int = 0
    host_seconds: float = 0.0


class EncoderCache:
    """LRU of `EncodedImage`s keyed by `ImageInput.key`, holding at most `max_tokens` image
    tokens (an image larger than that is encoded for its step and not kept)."""

    def __init__(self, encoder: Encoder, device: torch.device, max_tokens: int) -> None:
        self.encoder, self.device, self.max_tokens = encoder, device, max_tokens
        self._entries: OrderedDict[int, EncodedImage] = OrderedDict()
        self._tokens = 0
        self.stats = EncoderStats()
        # CUDA: (start, end) events of encoder passes not yet added to `_device_seconds`
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._device_seconds = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def embeds(self, parts: Sequence[StepImage]) -> VisionEmbeds:
        """A step's image features, in its query tokens' order (`parts` in step order)."""
        encoded = self._encode_missing([p.image for p in parts])
        index = np.concatenate([np.arange(p.dst, p.dst + p.count) for p in parts])
        rows = [encoded[p.image.key] for p in parts]
        ranges = [(p.first, p.first + p.count) for p in parts]
        return VisionEmbeds(
            token_index=torch.from_numpy(index).to(self.device, non_blocking=True),
            embeds=torch.cat([e.embeds[a:b] for e, (a, b) in zip(rows, ranges, strict=True)]),
            deepstack=torch.cat(
                [e.deepstack[:, a:b] for e, (a, b) in zip(rows, ranges, strict=True)], dim=1
            ),
        )

    def _encode_missing(self, images: list[ImageInput]) -> dict[int, EncodedImage]:
        """Every image's features: cached ones as they are, the rest in one encoder pass."""
        found: dict[int, EncodedImage] = {}
        missing: dict[int, ImageInput] = {}
        for image in images:
            entry = self._entries.get(image.key)
            if entry is not None:
                self._entries.move_to_end(image.key)
                found[image.key] = entry
            elif image.key not in missing and image.key not in found:
                missing[image.key] = image
        self.stats.cache_hits += len({i.key for i in images}) - len(missing)
        if missing:
            todo = list(missing.values())
            patches = torch.from_numpy(np.concatenate([i.pixel_values for i in todo]))
            t0 = time.perf_counter()
            timing = self._start_timing()
            outputs = self.encoder(patches.to(self.device), [i.grid_thw for i in todo])
            self._stop_timing(timing)
            self.stats.host_seconds += time.perf_counter() - t0
            self.stats.images_encoded += len(todo)
            for image, out in zip(todo, outputs, strict=True):
                found[image.key] = out
                self._keep(image, out)
        return found

    def _keep(self, image: ImageInput, out: EncodedImage) -> None:
        if image.num_tokens > self.max_tokens:
            return
        while self._tokens + image.num_tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old.embeds)
        self._entries[image.key] = out
        self._tokens += image.num_tokens

    def _start_timing(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if self.device.type != "cuda":
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _stop_timing(self, timing: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> None:
        if timing is not None:
            timing[1].record()
            self._events.append(timing)

    def encoder_seconds(self) -> float:
        """Seconds the encoder ran so far: on CUDA the device time of the passes that have
        finished (nothing waits: a pass still running counts once it is done), else host time."""
        if self.device.type != "cuda":
            return self.stats.host_seconds
        while self._events and self._events[0][1].query():
            start, end = self._events.pop(0)
            self._device_seconds += start.elapsed_time(end) / 1e3
        return self._device_seconds
