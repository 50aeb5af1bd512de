"""Option plumbing: RunnerConfig validation, flags generated from dataclasses, the registry."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from types import SimpleNamespace

import pytest
import torch

from tokenmill.bench.options import OfflineBenchArgs, ServeBenchArgs
from tokenmill.config import (
    ATTENTION_BACKENDS,
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
