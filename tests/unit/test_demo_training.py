"""scripts/train_demo_model.py: corpus cleaning, model sizes, and a short end-to-end run whose
checkpoints both transformers and tokenmill load and decode identically."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, long_test
from tokenmill import LLM, SamplingParams
from tokenmill.testing.checkpoints import build_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo_model.py"


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_demo_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_clean_rst_keeps_prose_and_drops_markup(demo) -> None:
    text = "Title\n=====\n\nUse :func:`open` or :class:`~io.TextIOWrapper <tw>`.\n\n\n\nEnd\n---\n"
    assert demo.clean_rst(text) == "Title\n\nUse open or io.TextIOWrapper.\n\nEnd\n"


def test_html_text_reads_sections_only(demo) -> None:
    page = (
        "<html><body><div class='nav'>Menu</div><div class='section' id='s'><h1>Models"
        "<a class='headerlink' href='#s'>¶</a></h1><p>A model is <code>one</code> table.</p>"
        "<div class='highlight'><pre>x = 1</pre></div><script>var a;</script></div></body></html>"
    )
    assert demo.html_text(page) == "Models\nA model is one table.\n\nx = 1\n"
    assert demo.html_text("<html><body><div>index</div></body></html>") == ""


def test_model_shapes_are_the_issue_sizes(demo) -> None:
    """≈ 10–20 M parameters for the model, ≈ 1–3 M for the draft, with the real 8,192 vocab."""
    tokenizer = build_tokenizer()
    sizes = {}
    for name, shape in (("big", demo.BIG), ("draft", demo.DRAFT)):
        model = demo.make_model(shape, tokenizer)
        model.resize_token_embeddings(demo.VOCAB_SIZE)
        sizes[name] = sum(p.numel() for p in model.parameters())
    assert 10e6 <= sizes["big"] <= 20e6 and 1e6 <= sizes["draft"] <= 3e6
    assert 2 * (sizes["big"] + sizes["draft"]) < 40e6  # bf16 bytes, before tokenizer files


def _corpus(root: Path) -> Path:
    import argparse
    import collections
    import json as json_mod
    import logging
    import pathlib
    import textwrap

    docs = [m.__doc__ or "" for m in (argparse, collections, json_mod, logging, pathlib, textwrap)]
    docs = [d * 3 for d in docs if len(d) > 500]
    root.mkdir()
    (root / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[1:]))
    (root / "heldout.jsonl").write_text(json.dumps(docs[0] * 2) + "\n")
    (root / "SOURCE.json").write_text(json.dumps({"packages": {"stdlib": 6}, "held_out_every": 6}))
    return root


@long_test("trains and evaluates both demo models for two steps: about 70 s")
def test_short_training_run_writes_checkpoints_that_load_everywhere(demo, tmp_path) -> None:
    out = tmp_path / "assets"
    run = demo.RunSettings(big_steps=2, draft_steps=2, batch_size=1, eval_windows=2)
    demo.train_all(_corpus(tmp_path / "corpus"), out, run)
    report = json.loads((out / "report.json").read_text())
    assert 0.0 <= report["draft_greedy_agreement"] <= 1.0
    assert len(report["samples"]) == len(demo.SAMPLE_PROMPTS)
    for name in (demo.BIG_NAME, demo.DRAFT_NAME):
        path = out / name
        assert report[name]["heldout_perplexity"] > 1.0
        assert "PSF License" in (path / "README.md").read_text()
        with safe_open(path / "model.safetensors", "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
        tokenizer = AutoTokenizer.from_pretrained(path)
        chat = [{"role": "user", "content": "Hi"}]
        assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer.encode("The list type", add_special_tokens=False)
        llm = LLM(str(path), dtype="float32")
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        [result] = llm.generate([prompt], greedy, use_tqdm=False)
        assert result.outputs[0].token_ids == hf_greedy(path, prompt, 12)
