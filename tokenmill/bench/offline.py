"""Offline benchmarks B1 (single-stream decode), B2 (throughput), B6 (prefill) and the data
workload, with the roofline or the matmul rate measured in the same run and, for B1 and B2, a
transformers peer."""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from typing import Any

import numpy as np
import torch

from tokenmill.bench.options import OfflineBenchArgs
from tokenmill.bench.roofline import (
    Hardware,
    ModelCost,
    batch_floor,
    measure_hardware,
    single_stream_floor,
)
from tokenmill.bench.workloads import WorkloadSpec, build_workload
from tokenmill.config import ModelConfig
from tokenmill.entrypoints.llm import LLM
from tokenmill.observability.histogram import Histogram
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _hardware(device: torch.device) -> Hardware | None:
    """Measured ceilings of the GPU; None on the CPU, where no roofline is modelled."""
    if device.type != "cuda":
        return None
    measured = measure_hardware(device)
    torch.cuda.empty_cache()  # its 2.3 GB of buffers: the engine's activations may need them
    return measured


def offline_llm(args: OfflineBenchArgs) -> LLM:
    """The engine a benchmark runs: dummy weights (unless `engine_kwargs` says otherwise) and,
    but for the data workload, which runs with the engine's defaults as a server would, no
    prefix caching (its prompts do not repeat)."""
    defaults: dict[str, Any] = {"load_format": "dummy", "enable_prefix_caching": False}
    if args.workload == "data":
        del defaults["enable_prefix_caching"]
    options = {"dtype": args.dtype, "device": args.device, "seed": args.seed, **defaults}
    return LLM(args.config, **{**options, **args.engine_kwargs})


def run_offline(args: OfflineBenchArgs) -> dict[str, Any]:
    """Run the workload on tokenmill and (optionally) its transformers peer; returns the report."""
    rng = np.random.default_rng(args.seed)
    cfg = ModelConfig.from_pretrained(args.config, args.dtype)
    llm = offline_llm(args)
    device = llm.engine.runner.device
    report, hw = report_header(args, llm)
    report["tokenmill"], floor = run_workload(llm, args, hw, rng)
    report.update(floor)
    llm.close()
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.peer and args.workload in ("b1", "b2"):
        report["transformers"] = _peer(args, cfg, rng, device)
    return report


def report_header(args: OfflineBenchArgs, llm: LLM) -> tuple[dict[str, Any], Hardware | None]:
    """The report's description of the run (model, device, the ceilings measured now) and the
    ceilings of the run's `tp` GPUs (None on the CPU)."""
    device = llm.engine.runner.device
    tp = llm.engine.runner.tp.size
    measured = _hardware(device)
    hw = None  # the ceilings of `tp` such GPUs: each reads and multiplies 1/tp of the model
    if measured is not None:
        hw = Hardware(measured.bandwidth * tp, measured.matmul_flops * tp)
    report: dict[str, Any] = {
        "workload": args.workload,
        "config": args.config,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "measured_copy_bandwidth_TBps": measured.bandwidth / 1e12 if measured else None,
        "measured_matmul_TFLOPs": measured.matmul_flops / 1e12 if measured else None,
        "engine_args": args.engine_kwargs,
        "tensor_parallel_size": tp,
    }
    return report, hw


def run_workload(
    llm: LLM, args: OfflineBenchArgs, hw: Hardware | None, rng: np.random.Generator
) -> tuple[dict[str, Any], dict[str, float]]:
    """B1, B2, B6 or data on `llm`: the measurements, and the floor of B1 or B2 when `hw` is
    known (B6 and data report the share of `hw`'s matmul rate they used)."""
    cfg = llm.config.model
    cost = ModelCost.of(cfg, torch.empty((), dtype=cfg.dtype).element_size())
    if args.workload == "b1":
        result: dict[str, Any] = _b1(llm, cfg.vocab_size, args, rng)
        if hw is not None:
            floor = single_stream_floor(cost, args.input_len, args.output_len, hw)
            result["pct_of_roofline"] = 100 * floor / result["tpot_s"]
            return result, {"roofline_tok_s": 1 / floor}
        return result, {}
    if args.workload == "b2":
        prompts_len = rng.integers(args.min_len, args.max_len + 1, args.num_requests)
        outputs_len = rng.integers(args.min_len, args.max_len + 1, args.num_requests)
        prompts = [rng.integers(10, cfg.vocab_size, n).tolist() for n in prompts_len]
        result = _b2(llm, prompts, outputs_len.tolist())
        if hw is not None:
            ideal = batch_floor(cost, prompts_len, outputs_len, hw)
            output_tok_s = float(outputs_len.sum()) / ideal
            result["pct_of_roofline"] = 100 * result["output_tok_s"] / output_tok_s
            return result, {"roofline_ideal_s": ideal, "roofline_output_tok_s": output_tok_s}
        return result, {}
    if args.workload == "b6":
        prompts = rng.integers(10, cfg.vocab_size, (args.num_requests, args.input_len)).tolist()
        outputs = [1] * args.num_requests
        extra = {"input_len": args.input_len}
    elif args.workload == "data":
        turns = [session.turns[0] for session in build_workload(data_workload(args, cfg))]
        prompts, outputs = [t.new_tokens for t in turns], [t.max_tokens for t in turns]
        extra = {"length_scale": args.length_scale}
    else:
        raise ValueError(f"workload must be b1, b2, b6 or data, got {args.workload!r}")
    result = {**extra, **_b2(llm, prompts, outputs)}
    result["prompt_tok_s"] = sum(map(len, prompts)) / result["elapsed_s"]
    result["flops"] = cost.sequence_flops(np.array(list(map(len, prompts))), np.array(outputs))
    if hw is not None:
        result["pct_of_matmul_rate"] = pct_of_matmul_rate(result["flops"], result["elapsed_s"], hw)
    return result, {}


def data_workload(args: OfflineBenchArgs, cfg: ModelConfig) -> WorkloadSpec:
    """The serving benchmark's data workload of `args` (the same requests as `bench serve
    --workload data` with the same --num-requests, --seed and --length-scale)."""
    return WorkloadSpec(
        "data", num_sessions=args.num_requests, vocab_size=cfg.vocab_size, seed=args.seed,
        length_scale=args.length_scale,
    )  # fmt: skip


def pct_of_matmul_rate(flops: float, seconds: float, hw: Hardware) -> float:
    """How much of the matmul rate `flops` done in `seconds` used, in percent."""
    return 100 * flops / seconds / hw.matmul_flops


def _b1(llm: LLM, vocab: int, args: OfflineBenchArgs, rng: np.random.Generator) -> dict[str, float]:
    def prompt() -> list[int]:
        return rng.integers(10, vocab, args.input_len).tolist()

    full = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt()], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    ttfts, totals = [], []
    for _ in range(3):
        ttfts.append(_timed(lambda: llm.generate([prompt()], first, use_tqdm=False)))
        totals.append(_timed(lambda: llm.generate([prompt()], full, use_tqdm=False)))
    ttft, total = statistics.median(ttfts), statistics.median(totals)
    tpot = (total - ttft) / (args.output_len - 1)
    return {
        "ttft_s": ttft,
        "total_s": total,
        "tpot_s": tpot,
        "output_tok_s": args.output_len / total,
        "decode_tok_s": 1 / tpot,
    }


def _counts(histograms: dict[str, Histogram]) -> dict[str, tuple[int, float]]:
    """Each histogram's (count, total)."""
    return {k: (h.count, h.total) for k, h in histograms.items()}


def _since(
    histograms: dict[str, Histogram], before: dict[str, tuple[int, float]]
) -> dict[str, tuple[int, float]]:
    """Each histogram's (count, total) added since `before` (`_counts`)."""
    return {k: (h.count - before[k][0], h.total - before[k][1]) for k, h in histograms.items()}


def _b2(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    # Warm up on the first prompts reversed: their lengths, but nothing the measured run could
    # find in the prefix cache.
    llm.generate([p[::-1] for p in prompts[:8]], params[:8], use_tqdm=False)
    stats = llm.engine.stats
    steps, host, device = (
        stats.step_seconds.count,
        stats.step_seconds.total,
        stats.forward_seconds.total,
    )
    device_before = _counts(stats.forward_seconds_by_kind)
    host_before = _counts(stats.step_seconds_by_kind)
    elapsed = _timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    steps = stats.step_seconds.count - steps
    device_by_kind = _since(stats.forward_seconds_by_kind, device_before)
    host_by_kind = _since(stats.step_seconds_by_kind, host_before)
    kinds = {
        k: {
            "steps": forwards,
            "device_s": seconds,
            "host_ms": 1e3 * host_by_kind[k][1] / max(host_by_kind[k][0], 1),
        }
        for k, (forwards, seconds) in device_by_kind.items()
    }
    total_in = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "output_tok_s": sum(outputs) / elapsed,
        "total_tok_s": (sum(outputs) + total_in) / elapsed,
        "requests": len(prompts),
        "engine_steps": steps,
        # Host time per step (not waiting for the device) and the device's busy fraction
        # (sum of per-step forward+sampling device time over the wall time). On the CPU the
        # forward runs on the host, so there the host time includes it.
        "host_ms_per_step": 1e3 * (stats.step_seconds.total - host) / max(steps, 1),
        "device_busy_fraction": (stats.forward_seconds.total - device) / elapsed,
        # Steps and their device time by kind (prefill-only, mixed, decode-only), and the host
        # ms a step of the engine steps that launched them.
        "steps_by_kind": kinds,
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _peer(
    args: OfflineBenchArgs, cfg: ModelConfig, rng: np.random.Generator, device: torch.device
) -> dict[str, Any]:
    """transformers on random weights of the same shapes: `generate` (B1), `generate_batch` (B2)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    hf_cfg = AutoConfig.from_pretrained(args.config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=cfg.dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if args.workload == "b1":
        ids = torch.tensor(
            [rng.integers(10, cfg.vocab_size, args.input_len).tolist()], device=device
        )
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        elapsed = _timed(
            lambda: model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
            )
        )
        return {"method": "generate", "output_tok_s": args.output_len / elapsed, "total_s": elapsed}
    n = args.peer_requests
    prompts = [rng.integers(10, cfg.vocab_size, int(k)).tolist()
               for k in rng.integers(args.min_len, args.max_len + 1, n)]  # fmt: skip
    gen_cfg = GenerationConfig(
        max_new_tokens=256, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen_cfg)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    return {
        "method": f"generate_batch, first {n} requests, 256 output tokens each",
        "output_tok_s": produced / elapsed,
        "elapsed_s": elapsed,
    }


def summary_rows(report: dict[str, Any]) -> list[str]:
    """A short human-readable table of a report."""
    ours = report["tokenmill"]
    peer = report.get("transformers")
    peer_text = (
        f"transformers {peer['output_tok_s']:.1f} tok/s ({peer['method']})"
        if peer
        else "transformers not run"
    )
    name = report["config"].rstrip("/").rsplit("/", 1)[-1]
    if report["workload"] == "b1":
        roofline = (
            f"{ours['pct_of_roofline']:.0f}% of roofline {report['roofline_tok_s']:.0f} tok/s"
            if "pct_of_roofline" in ours
            else "no roofline on the CPU"
        )
        return [
            f"B1 {name}: tokenmill {ours['output_tok_s']:.0f} tok/s "
            f"(TPOT {ours['tpot_s'] * 1e3:.2f} ms, TTFT {ours['ttft_s'] * 1e3:.1f} ms, "
            f"{roofline}); {peer_text}"
        ]
    roofline = (
        f"{ours['pct_of_roofline']:.0f}% of ideal {report['roofline_output_tok_s']:.0f}"
        if "pct_of_roofline" in ours
        else "no roofline on the CPU"
    )
    if report["workload"] in ("b6", "data"):
        return [long_prompts_row(report["workload"], name, ours), steps_row(ours)]
    return [
        f"B2 {name}: tokenmill {ours['output_tok_s']:.0f} output tok/s, "
        f"{ours['total_tok_s']:.0f} total tok/s in {ours['elapsed_s']:.1f} s ({roofline}; "
        f"host {ours['host_ms_per_step']:.2f} ms/step, device busy "
        f"{100 * ours['device_busy_fraction']:.0f}%); {peer_text}",
        steps_row(ours),
    ]


def steps_row(result: dict[str, Any]) -> str:
    """The measured run's steps by kind: how many, and the device and host time of each on
    average."""
    cells = [
        f"{kind if kind == 'mixed' else kind + '-only'} {k['steps']} "
        f"({1e3 * k['device_s'] / k['steps']:.2f} / {k['host_ms']:.2f} ms)"
        for kind, k in result["steps_by_kind"].items()
        if k["steps"]
    ]
    return "  steps: " + ", ".join(cells) + " of device / host time each"


def long_prompts_row(workload: str, name: str, result: dict[str, Any]) -> str:
    """One line of a B6 or data run of `run_workload`: throughput and share of the matmul rate."""
    share = (
        f"{result['pct_of_matmul_rate']:.1f}% of the matmul rate"
        if "pct_of_matmul_rate" in result
        else "no matmul rate on the CPU"
    )
    if workload == "b6":
        return (
            f"B6 {name}: {result['requests']} x {result['input_len']}-token prompts, "
            f"{result['prompt_tok_s']:.0f} prompt tok/s ({share}) in {result['elapsed_s']:.2f} s"
        )
    return (
        f"data {name}: LLM.generate {result['requests']} requests, {result['total_tok_s']:.0f} "
        f"total tok/s ({share}) in {result['elapsed_s']:.2f} s"
    )


def write_report(report: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)
