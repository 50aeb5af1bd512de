"""The embedded demo model and its draft: standard checkpoints that transformers decodes exactly as
tokenmill does, trained (low perplexity on new text), with a draft that mostly agrees."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.config import ASSETS_DIR, DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from tokenmill.entrypoints.cli import main

# Written for this test (not from the training documents), in the style of the documentation.
NEW_TEXT = (
    "A list is a mutable sequence. You can append an item to the end of a list, insert an item "
    "at a given position, or remove the first item whose value is equal to x. The sort() method "
    "sorts the list in place, and the sorted() function returns a new sorted list. To create a "
    "new model, define a class that inherits from django.db.models.Model and add a field for "
    "each column of the database table."
)
PROMPTS = ["The list type", "To open a file for reading,", "A Django view is"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@functools.cache
def _hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_checkpoints_are_small_standard_and_share_the_tokenizer() -> None:
    files = [f for d in (DEMO_MODEL_DIR, DEMO_DRAFT_DIR) for f in d.iterdir()]
    assert sum(f.stat().st_size for f in files) <= 40e6
    needed = {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    for d in (DEMO_MODEL_DIR, DEMO_DRAFT_DIR):
        assert needed <= {f.name for f in d.iterdir()}
        assert "PSF License" in (d / "README.md").read_text()
    same = (DEMO_MODEL_DIR / "tokenizer.json").read_bytes()
    assert (DEMO_DRAFT_DIR / "tokenizer.json").read_bytes() == same
    big, draft = (
        sum(p.numel() for p in _hf(d).parameters()) for d in (DEMO_MODEL_DIR, DEMO_DRAFT_DIR)
    )
    assert 10e6 <= big <= 20e6 and 1e6 <= draft <= 3e6


@pytest.mark.parametrize("path", [DEMO_MODEL_DIR, DEMO_DRAFT_DIR], ids=["model", "draft"])
def test_greedy_tokens_equal_transformers(tokenizer, path: Path) -> None:
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    llm = LLM(str(path), dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert ours == [hf_greedy(path, prompt, 32) for prompt in prompts]


def _perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    return math.exp(loss.item())


def test_models_are_trained_and_the_report_says_so(tokenizer) -> None:
    """Perplexity on new text is far below the 8,192 of a uniform guess, and the shipped report
    (the README's numbers) says the same of the held-out documents."""
    ids = tokenizer.encode(NEW_TEXT)
    big, draft = _perplexity(_hf(DEMO_MODEL_DIR), ids), _perplexity(_hf(DEMO_DRAFT_DIR), ids)
    assert big < 100 and draft < 200
    report = json.loads((ASSETS_DIR / "report.json").read_text())
    for name in (DEMO_MODEL_DIR.name, DEMO_DRAFT_DIR.name):  # the GPU run's: 24.1 and 27.3
        assert report[name]["heldout_perplexity"] < 40
    assert report["draft_greedy_agreement"] > 0.3


def test_draft_mostly_agrees_with_the_model(tokenizer) -> None:
    """Teacher-forced on the model's own greedy continuation, the draft's argmax matches it at
    a good share of positions (what speculative decoding will accept)."""
    draft = _hf(DEMO_DRAFT_DIR)
    agree = total = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        seq = torch.tensor([ids + hf_greedy(DEMO_MODEL_DIR, ids, 32)])
        with torch.no_grad():
            guess = draft(input_ids=seq[:, :-1]).logits[0, len(ids) - 1 :].argmax(-1)
        agree += (guess == seq[0, len(ids) :]).sum().item()
        total += guess.numel()
    assert agree / total > 0.3


def test_generate_without_model_uses_the_demo(capsys) -> None:
    main(["--log-level", "WARNING", "generate", "The list type", "--max-tokens", "16"])
    text = capsys.readouterr().out
    assert len(text.split()) >= 5
