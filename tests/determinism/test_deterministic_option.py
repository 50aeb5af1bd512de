"""The `deterministic` engine option: a flag on every command, an `LLM` keyword, refused where
the engine cannot keep its promise."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokenmill.config import EngineArgs, RunnerConfig
from tokenmill.entrypoints.cli import _engine_kwargs, add_engine_args, engine_args_from


def test_flag_and_bench_engine_arg_set_it() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args(["--deterministic"])).deterministic
    assert not engine_args_from(parser.parse_args([])).deterministic
    assert "--deterministic" in parser.format_help()
    assert _engine_kwargs(["deterministic=true"]) == {"deterministic": True}


def test_runner_gets_it(llama_dir: Path) -> None:
    config = EngineArgs(model=str(llama_dir), device="cpu", deterministic=True)
    assert config.create_engine_config().runner.deterministic


def test_flashinfer_is_refused() -> None:
    with pytest.raises(ValueError, match="deterministic needs attention_backend torch or triton"):
        RunnerConfig(attention_backend="flashinfer", deterministic=True)


def test_tensor_parallelism_is_refused(llama_dir: Path) -> None:
    args = EngineArgs(
        model=str(llama_dir), device="cpu", deterministic=True, tensor_parallel_size=2
    )
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not work with deterministic"):
        args.create_engine_config()
