"""tokenmill: a small, fast, observable LLM inference engine with an OpenAI-compatible server."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
