"""The options of each `tokenmill eval` command, as dataclasses: the CLI makes one flag per field
(`entrypoints.cli.add_options`) and the evals take the dataclass. Kept apart from the evals so
that building the CLI imports no model code."""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass

from tokenmill.config import option

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
PRECISIONS = ("auto", "float32", "bfloat16", "float16")


def check_base_url(url: str) -> None:
    """`ValueError` naming base_url unless `url` is an http(s) URL with a host (httpx's own
    error for a malformed one, `InvalidURL`, is no `httpx.HTTPError`)."""
    import httpx  # here: building the CLI imports no HTTP client

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"base_url: {exc}, got {url!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"base_url must be an http(s) URL such as {DEFAULT_BASE_URL}, got {url!r}")


def default_api_key() -> str | None:
    """The key the server expects, as tokenmill's and OpenAI's clients find it."""
    return os.environ.get("TOKENMILL_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


@dataclass(frozen=True)
class Thresholds:
    """Where conformance fails: per generated position, over every sequence together."""

    min_top1: float  # fraction of positions where the server's greedy token is the reference's
    max_mean_kl: float  # mean KL(reference || server) over the server's top-k plus the rest
    max_logprob_error: float  # largest |server - reference| logprob of any token the server listed


# Starting points, per precision the server computes in (the reference is float32): float32
# differs only by summation order; half precisions round every activation to 8 or 11 bits, so
# near-ties flip and logprobs move by tenths.
THRESHOLDS = {
    "float32": Thresholds(min_top1=0.98, max_mean_kl=1e-4, max_logprob_error=0.01),
    "float16": Thresholds(min_top1=0.90, max_mean_kl=0.02, max_logprob_error=0.5),
    "bfloat16": Thresholds(min_top1=0.85, max_mean_kl=0.05, max_logprob_error=1.0),
}


@dataclass(frozen=True)
class ConformanceArgs:
    """`tokenmill eval conformance`: a live server's logprobs against transformers."""

    model: str = option(
        MISSING,
        "The checkpoint directory the server loaded (config.json, *.safetensors, tokenizer): "
        "the reference runs transformers on it.",
    )
    base_url: str = option(DEFAULT_BASE_URL, "Server address.")
    served_model_name: str | None = option(
        None, "Model name to send.", default_help="the server's first model in /v1/models"
    )
    tokenizer: str | None = option(
        None, "Tokenizer directory, if not the model directory.", default_help="--model"
    )
    api_key: str | None = option(
        None, "Api key of the server.", default_help="$TOKENMILL_API_KEY or $OPENAI_API_KEY"
    )
    max_tokens: int = option(32, "Tokens generated per prompt (greedy, EOS ignored).")
    top_logprobs: int = option(
        5, "Alternatives the server returns per position (KL and logprob errors use them)."
    )
    lengths: str = option(
        "16,256,2048",
        "Prompt lengths (tokens) of the text and token-id prompts; those that do not fit the "
        "server's context are shortened to fit.",
    )
    concurrency: int = option(8, "Requests in flight at once.")
    seed: int = option(0, "Seed of the token-id prompts.")
    server_dtype: str = option(
        "auto",
        "Precision the server computes in, which picks the default thresholds (auto: "
        "config.json's torch_dtype, what `tokenmill serve --dtype auto` uses).",
        choices=PRECISIONS,
    )
    min_top1: float | None = option(
        None, "Fail below this top-1 agreement.",
        default_help="by --server-dtype: 0.98 float32, 0.90 float16, 0.85 bfloat16",
    )  # fmt: skip
    max_mean_kl: float | None = option(
        None, "Fail above this mean KL per position.",
        default_help="1e-4 float32, 0.02 float16, 0.05 bfloat16",
    )  # fmt: skip
    max_logprob_error: float | None = option(
        None, "Fail above this largest logprob error.",
        default_help="0.01 float32, 0.5 float16, 1.0 bfloat16",
    )  # fmt: skip
    reference_dtype: str = option(
        "float32", "dtype of the transformers reference.", choices=PRECISIONS[1:]
    )
    reference_device: str | None = option(
        None, "Device of the reference.", default_help="cuda if present"
    )
    max_divergences: int = option(10, "First divergences shown (one per sequence at most).")
    timeout: float = option(600.0, "Seconds one request may take.")

    def __post_init__(self) -> None:
        check_base_url(self.base_url)
        if not 1 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [1, 20], got {self.top_logprobs}")
        for name in ("max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        self.prompt_lengths  # noqa: B018 - validates the text

    @property
    def prompt_lengths(self) -> tuple[int, ...]:
        try:
            lengths = tuple(int(x) for x in self.lengths.split(",") if x.strip())
        except ValueError:
            lengths = ()
        if not lengths or min(lengths) < 1:
            raise ValueError(
                f"lengths must be positive integers, e.g. 16,256, got {self.lengths!r}"
            )
        return lengths


@dataclass(frozen=True)
class TaskEvalArgs:
    """`tokenmill eval tasks`: a task file's prompts against a live server, scored."""

    base_url: str = option(DEFAULT_BASE_URL, "Server address.")
    served_model_name: str | None = option(
        None, "Model name to send.", default_help="the server's first model in /v1/models"
    )
    api_key: str | None = option(
        None, "Api key of the server.", default_help="$TOKENMILL_API_KEY or $OPENAI_API_KEY"
    )
    concurrency: int = option(8, "Requests in flight at once.")
    max_tokens: int = option(32, "Tokens per answer, where a task gives no max_tokens.")
    min_accuracy: float = option(
        0.0, "Exit with status 1 when fewer than this fraction of the tasks pass."
    )
    timeout: float = option(600.0, "Seconds one request may take.")
    progress: bool = option(True, "Show a progress bar (on stderr).")

    def __post_init__(self) -> None:
        check_base_url(self.base_url)
        for name in ("max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if not 0 <= self.min_accuracy <= 1:
            raise ValueError(f"min_accuracy must be in [0, 1], got {self.min_accuracy}")


@dataclass(frozen=True)
class DummyCheckpointArgs:
    """`tokenmill eval dummy-checkpoint`: random weights written as a checkpoint directory."""

    config: str = option(
        MISSING, "Directory holding config.json (e.g. shared/models/llama-3.1-8b)."
    )
    output: str = option(MISSING, "Directory to write (config, safetensors, tokenizer).")
    tokenizer: str | None = option(
        None, "Tokenizer directory to copy in.", default_help="the demo model's"
    )
    dtype: str = option("bfloat16", "dtype of the weights written.", choices=PRECISIONS[1:])
    seed: int = option(0, "Seed of the weights.")
    device: str | None = option(
        None, "Device the weights are drawn on (a GPU is faster).", default_help="cuda if present"
    )
