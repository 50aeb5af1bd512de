"""What `tokenmill serve`'s processes import before their first completion: the api server,
its early start and its tokenizer workers import no torch (seconds of start-up each), so the
engine core's start-up alone is the critical path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.config import DEMO_MODEL_DIR, EngineArgs


def _modules_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter has imported after running `code`."""
    script = (
        f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    return set(out.split())


def test_api_server_and_early_start_import_no_torch_or_transformers() -> None:
    """The server's start-up path: `tokenmill serve`'s command line, the early start of the
    engine core and workers, the api server module (torch alone is seconds of start-up)."""
    modules = _modules_after(
        "import tokenmill.__main__, tokenmill.entrypoints.cli, tokenmill.entrypoints.early_start\n"
        "import tokenmill.entrypoints.api_server"
    )
    assert not modules & {"torch", "transformers"}


def test_loading_a_tokenizer_imports_no_torch(llama_dir: Path) -> None:
    modules = _modules_after(
        "from tokenmill.tokenization.tokenizer import load_tokenizer\n"
        f"assert load_tokenizer({str(llama_dir)!r}) is not None\n"
        f"assert load_tokenizer({str(DEMO_MODEL_DIR)!r}) is not None"
    )
    assert "transformers" in modules
    assert "torch" not in modules


def test_resolving_the_served_model_imports_no_torch(llama_dir: Path) -> None:
    modules = _modules_after(
        "from tokenmill.config import EngineArgs\n"
        f"EngineArgs(model={str(llama_dir)!r}, max_model_len=100).create_served_model()"
    )
    assert "torch" not in modules


@pytest.mark.parametrize(
    "options", [{}, {"max_model_len": 100, "generation_config": "vllm", "max_images_per_prompt": 2}]
)
def test_the_served_model_is_the_engine_configurations(
    checkpoints: dict[str, Path], vl_dir: Path, options: dict[str, object]
) -> None:
    for path in [*checkpoints.values(), vl_dir, DEMO_MODEL_DIR]:
        args = EngineArgs(model=str(path), device="cpu", **options)  # type: ignore[arg-type]
        assert args.create_served_model() == args.create_engine_config().served_model, path


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"model": ""}, "model must be a checkpoint directory"),
        ({"model": "/no/such/checkpoint"}, "does not exist"),
        ({"dtype": "float64"}, "dtype must be one of auto"),
        ({"max_model_len": 0}, "max_model_len must be >= 2"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),  # no request could ever run
        ({"max_image_bytes": -1}, "max_image_bytes must be >= 0"),
        ({"load_format": "gguf"}, "load_format must be auto or dummy"),
        ({"tokenizer": "/no/such/tokenizer"}, "tokenizer must be a directory holding"),
    ],
)
def test_the_served_model_refuses_what_the_engine_configuration_refuses(
    llama_dir: Path, options: dict[str, object], error: str
) -> None:
    args = EngineArgs(**{"model": str(llama_dir), "device": "cpu", **options})  # type: ignore[arg-type]
    for resolve in (args.create_served_model, args.create_engine_config):
        with pytest.raises(ValueError, match=error):
            resolve()


@pytest.mark.parametrize(
    ("option", "error"),
    [("device", "device must be cpu, cuda"), ("attention_backend", "attention_backend must be"),
     ("cuda_graph_capture", "cuda_graph_capture must be")],
)  # fmt: skip
def test_an_empty_choice_is_refused_not_taken_for_auto(
    llama_dir: Path, option: str, error: str
) -> None:
    """None means "choose for me"; an empty string is a mistake (it used to mean the same)."""
    with pytest.raises(ValueError, match=error):
        EngineArgs(model=str(llama_dir), **{option: ""}).create_engine_config()  # type: ignore[arg-type]


@pytest.mark.parametrize(("seed", "error"), [(-1, "seed must be in"), (2**64, "past 64 bits")])
def test_an_engine_seed_out_of_range_is_refused(llama_dir: Path, seed: int, error: str) -> None:
    """A negative seed (torch would wrap it) as a request's is refused, as is one past 64 bits."""
    with pytest.raises(ValueError, match=error):
        EngineArgs(model=str(llama_dir), device="cpu", seed=seed).create_engine_config()
