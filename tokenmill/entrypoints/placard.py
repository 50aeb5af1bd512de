"""The museum placard demo: a vision-language model writes the placard that would hang beside
each image if it were an artwork (`tokenmill placard IMAGE... --model DIR`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.entrypoints.llm import LLM
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

PLACARD_PROMPT = (
    "You are the curator of an art museum. This image is a work in your collection. Write "
    "the placard that hangs beside it: on the first line its title; on the second line the "
    "artist (invent a plausible one if unknown), the medium and a year; then one paragraph "
    "of 60 to 90 words describing what the work shows, its composition and its mood, in "
    "the calm voice of a museum label."
)


def placard_messages(image: str | Path, prompt: str = PLACARD_PROMPT) -> list[dict[str, Any]]:
    """The chat asking for one image's placard (the image as a file path: offline only)."""
    parts = [{"type": "image", "image": str(image)}, {"type": "text", "text": prompt}]
    return [{"role": "user", "content": parts}]


def write_placards(
    llm: LLM, images: Sequence[str | Path], params: SamplingParams, prompt: str = PLACARD_PROMPT
) -> list[RequestOutput]:
    """One placard per image, generated together (one batch)."""
    if llm.images is None:
        raise ValueError(
            f"model {llm.config.model.path!r} ({llm.config.model.architecture}) takes no "
            "images; placards need a vision-language model such as Qwen3-VL"
        )
    conversations = [placard_messages(image, prompt) for image in images]
    return llm.chat(conversations, params, use_tqdm=False)
