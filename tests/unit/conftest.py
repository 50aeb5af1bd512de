"""Fixtures of the unit tests beyond the shared ones (`tests/conftest.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.testing.checkpoints import build_vl_checkpoint


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-VL checkpoint (its tokenizer has the vision tokens added)."""
    return build_vl_checkpoint(tmp_path_factory.mktemp("vl") / "qwen3_vl")
