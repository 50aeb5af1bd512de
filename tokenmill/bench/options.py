"""The options of each `tokenmill bench` command, as dataclasses: the CLI makes one flag per
field (`entrypoints.cli.add_options`), and the benchmarks take the dataclass. Kept apart from the
benchmarks so that building the CLI imports no model code."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

from tokenmill.bench.workloads import MAX_LENGTH, MAX_WORKLOAD_TOKENS, WorkloadSpec
from tokenmill.config import option

# The options only `--workload b4` reads.
B4_OPTIONS = (
    "num_speculative_tokens", "acceptance_rates", "batch_sizes", "adaptive_batch_sizes", "repeats"
)  # fmt: skip


@dataclass
class OfflineBenchArgs:
    """`tokenmill bench offline` (and the sizes `bench roofline` reads): B1, B2, B4, B6 or the
    data workload on dummy weights built from a config directory."""

    config: str = option(MISSING, "Directory holding config.json.")
    workload: str = option(
        "b1",
        "B1 (single-stream decode), B2 (throughput), B4 (speculative decoding vs plain), B6 "
        "(prefill: prompts of --input-len tokens, one output token each) or data (the serving "
        "benchmark's data workload through LLM.generate: the same token ids as `bench serve "
        "--workload data` with the same --seed and --num-requests, with the engine's default "
        "options, prefix caching included; the other workloads turn prefix caching off).",
        choices=("b1", "b2", "b4", "b6", "data"),
    )
    dtype: str = option("bfloat16", "Weight dtype.")
    device: str | None = option(None, "cpu or cuda.", default_help="cuda if present")
    num_requests: int = option(256, "B2, B6 and data requests.")
    input_len: int = option(
        0, "B1 and B6 prompt tokens.", default_help="512 for B1 and B4, 2048 for B6"
    )
    output_len: int = option(256, "B1 output tokens.")
    min_len: int = option(100, "B2 shortest input/output (lengths uniform in [min, max]).")
    max_len: int = option(1024, "B2 longest input/output.")
    length_scale: float = option(1.0, "data: scale every length (e.g. 0.05 on a CPU).")
    seed: int = option(0, "Seed for lengths and token ids.")
    peer: bool = option(True, "Also run the transformers peer.")
    peer_requests: int = option(32, "B2: requests the peer runs (it is slow).")
    num_speculative_tokens: int = option(4, "B4: drafts per verify (k).")
    acceptance_rates: str = option(
        "1.0,0.8,0.6", "B4: the oracle proposer's per-draft acceptance rates, comma-separated."
    )
    batch_sizes: str = option("1,64", "B4: the oracle runs' batch sizes, comma-separated.")
    adaptive_batch_sizes: str = option(
        "64",
        "B4: batch sizes (of --batch-sizes) whose oracle runs are repeated with adaptive "
        "speculation (drafts chosen per request and step), next to fixed k and plain decoding "
        "in the same run; comma-separated, empty for none.",
    )
    repeats: int = option(
        1,
        "B4: timed generations per oracle row (plain and speculative, each in its own engine); "
        "the row reports their median rate (a batch of 64 decodes for well under a second). "
        "They run in one engine after one warm-up: adaptive speculation's learnt step costs "
        "carry over from run to run, the speculation stats and costs reported cover them all, "
        "and the tokens compared with plain decoding are the last run's.",
    )
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # engine options, by name

    def __post_init__(self) -> None:
        if self.input_len < 0:
            raise ValueError(
                f"input_len must be >= 1 (or 0: the workload's default), got {self.input_len}"
            )
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.input_len:  # the workload's own default
            self.input_len = 2048 if self.workload == "b6" else 512
        if not 0 < self.length_scale < float("inf"):
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"min_len and max_len must satisfy 1 <= min_len <= max_len, got "
                f"{self.min_len} and {self.max_len}"
            )
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        self._check_sizes()
        self._check_b4()

    def _check_sizes(self) -> None:
        """Seed, B1's output (a decode step to time) and the bounds of the lengths and the
        prompts drawn up front (`workloads.MAX_LENGTH`, `MAX_WORKLOAD_TOKENS`)."""
        if self.seed < 0:  # numpy's own message names nothing
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.workload == "b1" and self.output_len < 2:  # its decode rate divides by it - 1
            raise ValueError(
                f"output_len must be >= 2 for b1 (it times decoding), got {self.output_len}"
            )
        if self.peer_requests < 1:
            raise ValueError(f"peer_requests must be >= 1, got {self.peer_requests}")
        for name in ("input_len", "output_len", "max_len"):
            if getattr(self, name) > MAX_LENGTH:
                raise ValueError(f"{name} must be <= {MAX_LENGTH}, got {getattr(self, name)}")
        if self.workload == "data":  # its sizes, checked before the model loads
            WorkloadSpec("data", self.num_requests, seed=self.seed, length_scale=self.length_scale)
        longest = self.max_len if self.workload == "b2" else self.input_len
        if self.workload in ("b2", "b6") and self.num_requests * longest > MAX_WORKLOAD_TOKENS:
            length = "max_len" if self.workload == "b2" else "input_len"
            raise ValueError(
                f"num_requests x {length} must be at most {MAX_WORKLOAD_TOKENS} prompt tokens, "
                f"got {self.num_requests} x {longest}"
            )

    def _check_b4(self) -> None:
        """B4's lists parse, and name their option when they do not."""
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        self.acceptance_rate_list()
        sizes = self.batch_size_list()
        adaptive = self.adaptive_batch_size_list()
        if not set(adaptive) <= set(sizes):
            raise ValueError(
                f"adaptive_batch_sizes must be some of batch_sizes ({self.batch_sizes}), "
                f"got {self.adaptive_batch_sizes!r}"
            )

    def acceptance_rate_list(self) -> list[float]:
        """`acceptance_rates` as numbers in [0, 1]."""
        rates = _comma_list("acceptance_rates", self.acceptance_rates, float, "numbers")
        if not rates or not all(0 <= r <= 1 for r in rates):
            raise ValueError(
                f"acceptance_rates must be numbers in [0, 1], got {self.acceptance_rates!r}"
            )
        return rates

    def batch_size_list(self) -> list[int]:
        """`batch_sizes` as integers >= 1."""
        sizes = _comma_list("batch_sizes", self.batch_sizes, int, "integers")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes!r}")
        return sizes

    def adaptive_batch_size_list(self) -> list[int]:
        """`adaptive_batch_sizes` as integers (none when empty)."""
        return _comma_list("adaptive_batch_sizes", self.adaptive_batch_sizes, int, "integers")


def _comma_list(name: str, text: str, kind: type, what: str) -> list[Any]:
    """The comma-separated values of option `name`; `ValueError` naming it (int()'s and
    float()'s messages name nothing)."""
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated {what}, got {text!r}") from None


@dataclass(frozen=True)
class ServeBenchArgs:
    """`tokenmill bench serve`: a load test of an OpenAI-compatible server."""

    base_url: str
    model: str = option(MISSING, "Model name the server serves.")
    workload: WorkloadSpec
    request_rate: float = float("inf")  # sessions per second; inf = all at once
    burstiness: float = option(1.0, "Gamma shape of arrivals (1 = Poisson, < 1 burstier).")
    max_concurrency: int | None = option(None, "Cap on open requests.", default_help="no cap")
    duration: float | None = option(
        None, "Stop starting sessions after this many seconds.", default_help="run them all"
    )
    slo_ttft: float | None = None  # seconds
    slo_itl: float | None = None  # seconds (mean inter-token gap of a request)
    timeout: float = option(600.0, "Seconds one request may take.")
    progress: bool = option(True, "Show a progress bar.")

    def __post_init__(self) -> None:
        # `not x > 0` refuses NaN too; an infinite rate is "all at once".
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not 0 < self.burstiness < float("inf"):
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
