"""Option plumbing: RunnerConfig validation, flags generated from dataclasses, the registry."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from dataclasses import MISSING, dataclass
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from tokenmill import config as config_module
from tokenmill.bench.options import OfflineBenchArgs, ServeBenchArgs
from tokenmill.config import (
    ATTENTION_BACKENDS,
    DEMO_MODEL_DIR,
    SUPPORTED_ARCHITECTURES,
    EngineArgs,
    RunnerConfig,
    option,
)
from tokenmill.entrypoints.cli import add_options, build_parser, options_from
from tokenmill.models.registry import MODEL_REGISTRY, model_class


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.01),
        ("gpu_memory_utilization", float("nan")),
        ("attention_backend", "cudnn"),
        ("cuda_graph_max_bs", 0),
        ("cuda_graph_max_prefill_tokens", -1),
        ("cuda_graph_capture", "lazy"),
    ],
)
def test_runner_config_rejects_bad_values_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RunnerConfig(**{field: value})


def test_engine_args_reach_the_runner_config(llama_dir) -> None:  # type: ignore[no-untyped-def]
    args = EngineArgs(model=str(llama_dir), device="cpu", gpu_memory_utilization=0.5)
    config = args.create_engine_config()
    assert config.runner.gpu_memory_utilization == 0.5
    assert config.runner.attention_backend == "torch"  # the CPU default
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(model=str(llama_dir), gpu_memory_utilization=2.0).create_engine_config()


def test_cuda_graph_capture_defaults_to_background_only_for_a_server(llama_dir) -> None:  # type: ignore[no-untyped-def]
    """Offline engines capture at start-up; `tokenmill serve`'s engine core (`for_server`) in
    the background, unless speculation or several devices need the graphs at start-up or the
    option is given; background capture with speculation is refused by name."""
    args = EngineArgs(model=str(llama_dir), device="cpu")
    assert args.create_engine_config().runner.cuda_graph_capture == "startup"
    assert args.for_server().create_engine_config().runner.cuda_graph_capture == "background"
    given = EngineArgs(model=str(llama_dir), device="cpu", cuda_graph_capture="startup")
    assert given.for_server().cuda_graph_capture == "startup"
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    speculative = EngineArgs(model=str(llama_dir), device="cpu", speculative_config=spec)
    assert speculative.for_server().create_engine_config().runner.cuda_graph_capture == "startup"
    with pytest.raises(ValueError, match="cuda_graph_capture"):
        EngineArgs(model=str(llama_dir), device="cpu", speculative_config=spec,
                   cuda_graph_capture="background").create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match="cuda_graph_capture"):
        soon = EngineArgs(model=str(llama_dir), device="cpu", cuda_graph_capture="soon")
        soon.create_engine_config()


def test_the_attention_backend_names_are_the_registry() -> None:
    """config lists the names (it cannot import the backends); they must be the registry's."""
    from tokenmill.attention import backend

    assert set(ATTENTION_BACKENDS) == set(backend._BACKENDS)


def test_every_supported_architecture_resolves_to_a_model_class() -> None:
    """The registry names its classes by import path; each must import."""
    for arch in SUPPORTED_ARCHITECTURES:
        cls = model_class(SimpleNamespace(architecture=arch))  # type: ignore[arg-type]
        assert isinstance(cls, type) and issubclass(cls, torch.nn.Module)
    assert set(SUPPORTED_ARCHITECTURES) == set(MODEL_REGISTRY)


@dataclass
class _Example:
    name: str = option(MISSING, "The name.")
    count: int | None = option(None, "How many.")
    fast: bool = option(True, "Go fast.")
    kind: str = option("a", "Which.", choices=("a", "b"))
    hidden: int = 3


def test_flags_come_from_the_fields() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, _Example, "example", skip=("hidden",))
    ns = parser.parse_args(["--name", "x", "--count", "4", "--no-fast", "--kind", "b"])
    assert options_from(ns, _Example) == _Example("x", 4, False, "b", 3)
    assert options_from(ns, _Example, count=9, hidden=1) == _Example("x", 9, False, "b", 1)
    assert options_from(parser.parse_args(["--name", "y"]), _Example) == _Example("y")
    with pytest.raises(SystemExit):  # --name is required, --kind has choices
        parser.parse_args(["--kind", "c"])
    assert "How many. (default: None)" in parser.format_help()


def _flags(argv: list[str]) -> str:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in argv:
        sub = sub[name]
        if name != argv[-1]:
            sub = sub._subparsers._group_actions[0].choices
    return sub.format_help()


@pytest.mark.parametrize(
    ("argv", "cls", "skip"),
    [
        (["bench", "offline"], OfflineBenchArgs, {"engine_kwargs"}),
        (["bench", "serve"], ServeBenchArgs, {"workload", "slo_ttft", "slo_itl"}),
    ],
)
def test_bench_flags_cover_their_dataclass(argv: list[str], cls: type, skip: set[str]) -> None:
    text = _flags(argv)
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            assert "--" + f.name.replace("_", "-") in text


def test_openmp_threads_sleep_while_they_wait_unless_the_user_says_otherwise() -> None:
    code = "import os, tokenmill, torch; print(os.environ['OMP_WAIT_POLICY'])"
    run = partial(subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert run(env=env, check=True).stdout.strip() == "PASSIVE"
    assert run(env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, check=True).stdout.strip() == "ACTIVE"


@pytest.mark.parametrize(
    ("native_bf16", "expected"), [(False, torch.float32), (True, torch.bfloat16)]
)
def test_auto_dtype_on_a_cpu_is_float32_unless_it_multiplies_bf16(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(config_module, "cpu_has_bf16_instructions", lambda: native_bf16)
    args = EngineArgs(model=str(DEMO_MODEL_DIR), device="cpu")  # a bf16 checkpoint
    assert args.create_engine_config().model.dtype == expected
    args = EngineArgs(model=str(DEMO_MODEL_DIR), device="cpu", dtype="bfloat16")
    assert args.create_engine_config().model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("page_size", "16", "page_size must be an integer, got '16'"),
        ("num_pages", 1.5, "num_pages must be an integer, got 1.5"),  # was a torch.zeros TypeError
        ("max_num_seqs", True, "max_num_seqs must be an integer, got True$"),
        ("seed", 2**70, "seed must be an integer, got 1180591620717411303424 \\(past 64 bits\\)"),
        ("gpu_memory_utilization", "0.5", "gpu_memory_utilization must be a number, got '0.5'"),
        ("enforce_eager", 1, "enforce_eager must be True or False, got 1"),
        ("tokenizer", 5, "tokenizer must be a string, got 5"),
    ],
)
def test_engine_args_of_the_wrong_type_name_the_field(
    field: str, value: object, message: str
) -> None:
    """Checked before anything is read, not a TypeError from a comparison deep in start-up."""
    args = EngineArgs(model=str(DEMO_MODEL_DIR), device="cpu", **{field: value})
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()


def test_a_model_directory_may_be_a_path() -> None:
    config = EngineArgs(model=DEMO_MODEL_DIR, device="cpu").create_engine_config()  # type: ignore[arg-type]
    assert config.model.path == str(DEMO_MODEL_DIR)
