"""`tokenmill placard IMAGE... --model DIR`: one placard per image, as `LLM.chat` writes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multimodal.conftest import random_image
from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.cli import main
from tokenmill.entrypoints.placard import placard_messages


def test_placard_prints_each_images_placard(
    vl_checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = vl_checkpoints["qwen3_vl"]
    images = []
    for seed, suffix in ((1, "png"), (2, "jpg")):
        images.append(tmp_path / f"frame{seed}.{suffix}")
        random_image(48, 40, seed).save(images[-1])
    argv = ["placard", *map(str, images), "--model", str(path), "--device", "cpu",
            "--dtype", "float32", "--max-tokens", "5", "--ignore-eos"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device="cpu")
    expected = llm.chat([placard_messages(i) for i in images], params)
    for image, out in zip(images, expected, strict=True):
        assert f"=== {image}\n{out.outputs[0].text.strip()}\n" in printed


def test_placard_refuses_a_text_only_model(llama_dir: Path, tmp_path: Path) -> None:
    image = tmp_path / "a.png"
    random_image(8, 8, 0).save(image)
    assert main(["placard", str(image), "--model", str(llama_dir), "--device", "cpu"]) == 2


def test_placard_refuses_a_missing_file(llama_dir: Path, tmp_path: Path) -> None:
    assert main(["placard", str(tmp_path / "none.png"), "--model", str(llama_dir)]) == 2
