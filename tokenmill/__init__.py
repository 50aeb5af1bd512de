"""tokenmill: a small, fast, observable LLM inference engine with an OpenAI-compatible server."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that wait by spinning (its default) take turns badly with any other busy
# process on the cores, the server's own workers included: the demo model's CPU decode fell
# from ~60 to 5-7 tok/s whenever another process ran (docs/perf-notes.md, session 10).
# Sleeping waiters keep it at 56-60. Set before torch loads OpenMP; the user's value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"

# Public names, imported on first use (PEP 562): `tokenmill --version` must not import torch.
_LAZY = {
    "LLM": "tokenmill.entrypoints.llm",
    "CompletionOutput": "tokenmill.outputs",
    "RequestOutput": "tokenmill.outputs",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
