"""Deterministic mode on a CUDA GPU (CUDA graphs on): each check runs in a fresh process
(`tests/gpu/determinism_cases.py`), since cuBLAS's split-K setting (still used by the torch
attention backend) is read once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).parents[2]


def _case(name: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.gpu.determinism_cases", name, str(tmp_path)],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_invariant_linear_rows_do_not_depend_on_the_row_count(tmp_path: Path) -> None:
    """The Triton invariant matmul: each row of a product of 1..512 rows is bitwise the row
    alone, through every tile it picks, on every product shape of Qwen3-0.6B and
    Llama-3.1-8B."""
    result = _case("linear", tmp_path)
    assert result["failures"] == []


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_request_output_is_the_same_in_any_batch(family: str, tmp_path: Path) -> None:
    """bfloat16, CUDA graphs: token ids and logprobs of a greedy and a seeded request, bitwise,
    alone / in batches of 1..64 / under budgets 16, 512, 8192 / after prefix hits."""
    result = _case(f"engine-{family}", tmp_path)
    assert result["failures"] == [], result
