"""The options of each `tokenmill bench` command, as dataclasses: the CLI makes one flag per
field (`entrypoints.cli.add_options`), and the benchmarks take the dataclass. Kept apart from the
benchmarks so that building the CLI imports no model code."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

from tokenmill.bench.workloads import WorkloadSpec
from tokenmill.config import option


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
    device: str | None = option(None, "cpu or cuda (None: cuda if present).")
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


@dataclass(frozen=True)
class ServeBenchArgs:
    """`tokenmill bench serve`: a load test of an OpenAI-compatible server."""

    base_url: str
    model: str = option(MISSING, "Model name the server serves.")
    workload: WorkloadSpec
    request_rate: float = float("inf")  # sessions per second; inf = all at once
    burstiness: float = option(1.0, "Gamma shape of arrivals (1 = Poisson, < 1 burstier).")
    max_concurrency: int | None = option(None, "Cap on open requests.")
    duration: float | None = option(None, "Stop starting sessions after this many seconds.")
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
