"""tokenmill: a small, fast, observable LLM inference engine with an OpenAI-compatible server."""

from tokenmill.entrypoints.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
