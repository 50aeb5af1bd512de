"""What the offline API returns: one RequestOutput per prompt, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.batch import Logprob


@dataclass
class CompletionOutput:
    """One generated sequence of a request (there are `n` of them)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and its completions, as vLLM's `RequestOutput`.

    `prompt_logprobs` (when `SamplingParams.prompt_logprobs` asks for them): one entry per
    prompt token, None for the first; entry i maps prompt token i, then its `prompt_logprobs`
    most likely alternatives, to their logprob and rank given the tokens before it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
