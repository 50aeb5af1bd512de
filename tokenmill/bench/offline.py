"""Offline benchmarks B1 (single-stream decode) and B2 (throughput), with a transformers peer."""

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
from tokenmill.config import ModelConfig
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _hardware(device: torch.device) -> Hardware | None:
    """Measured ceilings of the GPU; None on the CPU, where no roofline is modelled."""
    return measure_hardware(device) if device.type == "cuda" else None


def run_offline(args: OfflineBenchArgs) -> dict[str, Any]:
    """Run the workload on tokenmill and (optionally) its transformers peer; returns the report."""
    rng = np.random.default_rng(args.seed)
    cfg = ModelConfig.from_pretrained(args.config, args.dtype)
    cost = ModelCost.of(cfg, torch.empty((), dtype=cfg.dtype).element_size())
    llm = LLM(
        args.config,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        enable_prefix_caching=False,
        **args.engine_kwargs,
    )
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
    if args.workload == "b1":
        report["tokenmill"] = _b1(llm, cfg.vocab_size, args, rng)
        if hw is not None:
            floor = single_stream_floor(cost, args.input_len, args.output_len, hw)
            report["roofline_tok_s"] = 1 / floor
            report["tokenmill"]["pct_of_roofline"] = 100 * floor / report["tokenmill"]["tpot_s"]
    elif args.workload == "b2":
        prompts_len = rng.integers(args.min_len, args.max_len + 1, args.num_requests)
        outputs_len = rng.integers(args.min_len, args.max_len + 1, args.num_requests)
        prompts = [rng.integers(10, cfg.vocab_size, n).tolist() for n in prompts_len]
        report["tokenmill"] = _b2(llm, prompts, outputs_len.tolist())
        if hw is not None:
            ideal = batch_floor(cost, prompts_len, outputs_len, hw)
            report["roofline_ideal_s"] = ideal
            report["roofline_output_tok_s"] = float(outputs_len.sum()) / ideal
            report["tokenmill"]["pct_of_roofline"] = (
                100 * report["tokenmill"]["output_tok_s"] / report["roofline_output_tok_s"]
            )
    else:
        raise ValueError(f"workload must be b1 or b2, got {args.workload!r}")
    llm.close()
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.peer:
        report["transformers"] = _peer(args, cfg, rng, device)
    return report


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


def _b2(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> dict[str, float]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm up
    stats = llm.engine.stats
    steps, host, device = (
        stats.step_seconds.count,
        stats.step_seconds.total,
        stats.forward_seconds.total,
    )
    elapsed = _timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    steps = stats.step_seconds.count - steps
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
    return [
        f"B2 {name}: tokenmill {ours['output_tok_s']:.0f} output tok/s, "
        f"{ours['total_tok_s']:.0f} total tok/s in {ours['elapsed_s']:.1f} s ({roofline}; "
        f"host {ours['host_ms_per_step']:.2f} ms/step, device busy "
        f"{100 * ours['device_busy_fraction']:.0f}%); {peer_text}"
    ]


def write_report(report: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)
