"""Shared fixtures: tiny real checkpoints (trained BPE tokenizer + random weights), built once."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns 1-element arrays into loop bounds with `int(array)`, which
    NumPy 2.x rejects for non-0-d arrays; take the element instead."""
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # another Triton version: nothing to patch
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter()
from transformers import AutoModelForCausalLM  # noqa: E402

from tokenmill.batch import Logprob  # noqa: E402
from tokenmill.testing.checkpoints import TINY_CONFIGS, build_checkpoint  # noqa: E402

FAMILIES = tuple(TINY_CONFIGS)
# Files that take a minute or more on a 2-core CPU run first: CI's two xdist workers (each file
# on one, `--dist loadfile`) then finish together, instead of one of them running these alone
# at the end.
SLOW_FILES_FIRST = (
    "tests/test_readme.py",
    "tests/unit/test_demo_training.py",
    "tests/kernels/test_kernels.py",
    "tests/parallel/test_tensor_parallel.py",
    "tests/spec/test_spec_graphs.py",
    "tests/engine/test_graph_inputs.py",
    "tests/reliability/test_workers_supervision.py",
)


def long_test(why: str) -> pytest.MarkDecorator:
    """Skip unless `TOKENMILL_LONG_TESTS=1`: a test of a minute or more, kept out of the CI
    suite (which must stay under 15 minutes on 2 cores) and run before a release."""
    return pytest.mark.skipif(
        not os.environ.get("TOKENMILL_LONG_TESTS"), reason=f"{why}: TOKENMILL_LONG_TESTS=1 runs it"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put `SLOW_FILES_FIRST` first (stable: the rest keep their order)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint directory per architecture family."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: build_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_dir(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def draft_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `llama_dir` target without its last layer: another model that agrees with the
    target on some tokens, not all (drafts are both accepted and rejected)."""
    path = tmp_path_factory.mktemp("draft") / "llama"
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:-1]
    model.config.num_hidden_layers = len(model.model.layers)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (llama_dir / name).exists():
            shutil.copy(llama_dir / name, path / name)
    return path


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, EOS ignored, float32: the reference continuation."""
    model = _hf_model(path)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


_HF_MODELS: dict[Path, torch.nn.Module] = {}


def _hf_model(path: Path) -> torch.nn.Module:
    if path not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        _HF_MODELS[path] = model
    return _HF_MODELS[path]


def hf_logprobs(path: Path, tokens: list[int]) -> torch.Tensor:
    """Log-softmax of transformers' logits at every position of `tokens` (float32)."""
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_prompt_logprobs_match(
    scores: list[dict[int, Logprob] | None] | None,
    reference: torch.Tensor,
    prompt: list[int],
    tolerance: float = 1e-4,
) -> None:
    """`scores` (`RequestOutput.prompt_logprobs` of `prompt`, asked with 3 alternatives) are
    the `reference` log-softmax's (`hf_logprobs`), within `tolerance`: entry i (i >= 1) holds
    prompt token i first, with its logprob and rank, then the 3 most likely tokens in order;
    entry 0 is None."""
    assert scores is not None and len(scores) == len(prompt)
    assert scores[0] is None
    for i in range(1, len(prompt)):
        entry, row = scores[i], reference[i - 1]
        assert entry is not None
        token, *alternatives = entry
        assert token == prompt[i]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=tolerance)
        value = row[token].item()  # its rank: 1 + the tokens more likely, within the tolerance
        rank = entry[token].rank
        assert (row > value + tolerance).sum() + 1 <= rank <= (row > value - tolerance).sum() + 1
        top = row.topk(3)
        expected = [t for t in top.indices.tolist() if t != token]
        assert alternatives == expected
        assert {entry[t].rank for t in top.indices.tolist()} == {1, 2, 3}
        for t, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[t].logprob == pytest.approx(value, abs=tolerance)


@pytest.fixture
def socket_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The temporary directory of the servers a test starts (short: ipc:// paths are limited to
    ~100 bytes), where each keeps its socket folder (`tests.e2e.server.socket_folders`)."""
    root = Path(tempfile.mkdtemp(prefix="tm-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(root))
    yield root
    shutil.rmtree(root)
