"""Structured-output costs: B2-like throughput with a JSON schema on every request vs none, the
time to first token a new schema's compile adds (and a cached one's), and the engine's step time
while schemas compile.

Dummy weights (`load_format=dummy`) of a config-only model directory; the grammar needs a
tokenizer, so `--tokenizer` (default: the embedded demo model's byte-level BPE, 8,192 tokens)
stands in for the model's own. Token ids past the tokenizer's vocabulary are never allowed by a
grammar. Note: the mask work per token grows with the tokenizer's vocabulary (a real Qwen
tokenizer has 151k tokens), so the host cost measured with the demo tokenizer is a lower bound.

    python benchmarks/structured_outputs.py --config ../shared/models/qwen3-0.6b
    python benchmarks/structured_outputs.py --config ../shared/models/tiny-llama-cpu --small
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill import LLM, SamplingParams, StructuredOutputsParams

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "tokenmill" / "assets" / "demo-llama-16m"
# Long free-text fields: a random model fills the string until max_tokens, so constrained and
# free requests generate about as many tokens each.
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "title", "tags"],
}


def big_schema(salt: int, num_fields: int = 60) -> dict[str, Any]:
    """A schema no earlier request used (fresh field names), with patterns and enums."""
    props: dict[str, Any] = {}
    for i in range(num_fields):
        kind = i % 4
        if kind == 0:
            props[f"f{salt}_{i}"] = {"type": "string", "pattern": f"[a-z]{{1,{i % 9 + 1}}}@x{i}"}
        elif kind == 1:
            props[f"f{salt}_{i}"] = {"type": "integer", "minimum": -i, "maximum": 10 * i + 5}
        elif kind == 2:
            props[f"f{salt}_{i}"] = {"enum": [f"v{salt}_{i}_{j}" for j in range(5)]}
        else:
            props[f"f{salt}_{i}"] = {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}
    return {"type": "object", "properties": props, "required": list(props)[: num_fields // 2]}


def throughput(llm: LLM, prompts: list[list[int]], outputs: list[int], schema: Any) -> dict:
    constraint = None if schema is None else StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=constraint)
        for n in outputs
    ]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm up (and compile the schema)
    stats = llm.engine.stats
    steps, host = stats.step_seconds.count, stats.step_seconds.total
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    steps = stats.step_seconds.count - steps
    valid = None
    if schema is not None:
        valid = sum(
            _parses(r.outputs[0].text) for r in results if r.outputs[0].finish_reason == "stop"
        )
    return {
        "elapsed_s": elapsed,
        "generated_tokens": generated,
        "output_tok_s": generated / elapsed,
        "engine_steps": steps,
        "host_ms_per_step": 1e3 * (stats.step_seconds.total - host) / max(steps, 1),
        "finished_by_grammar_and_parsed": valid,
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def ttft(llm: LLM, prompt: list[int], repeats: int) -> dict[str, float]:
    """Median time to first token: free, a new schema (compiled on arrival), the same cached."""

    def first(constraint: StructuredOutputsParams | None) -> float:
        params = SamplingParams(temperature=0, max_tokens=1, structured_outputs=constraint)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    free, new, cached = [], [], []
    for trial in range(repeats):
        constraint = StructuredOutputsParams(json=big_schema(1000 + trial))
        free.append(first(None))
        new.append(first(constraint))
        cached.append(first(constraint))
    med = statistics.median
    return {
        "ttft_free_s": med(free),
        "ttft_new_schema_s": med(new),
        "ttft_cached_schema_s": med(cached),
        "added_by_compile_s": med(new) - med(free),
        "added_when_cached_s": med(cached) - med(free),
    }


def steps_while_compiling(
    llm: LLM, prompts: list[list[int]], num_schemas: int, salt: int = 5000
) -> dict:
    """Wall time of each engine step over a decode batch, with and without compiles running
    (schemas `salt`, `salt + 1`, ...: new ones for each call)."""
    engine = llm.engine
    window = llm.config.max_model_len  # each decode runs to the end of its window
    for i, p in enumerate(prompts):
        free = SamplingParams(temperature=0, max_tokens=window - len(p), ignore_eos=True)
        engine.add_request(f"decode-{i}", p, free)
    quiet: list[float] = []
    busy: list[float] = []
    for _ in range(40):
        start = time.perf_counter()
        engine.step()
        quiet.append(time.perf_counter() - start)
    for i in range(num_schemas):
        constraint = StructuredOutputsParams(json=big_schema(salt + i, num_fields=120))
        engine.add_request(
            f"compile-{i}", prompts[0], SamplingParams(max_tokens=1, structured_outputs=constraint)
        )
    while engine.num_compiling:
        start = time.perf_counter()
        engine.step()
        busy.append(time.perf_counter() - start)
    for rid in engine.request_ids():
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()

    def stats(xs: list[float]) -> dict[str, float]:
        return {"steps": len(xs), "median_ms": 1e3 * statistics.median(xs),
                "p90_ms": 1e3 * float(np.percentile(xs, 90)), "max_ms": 1e3 * max(xs)}  # fmt: skip

    compiler = engine.grammar_compiler
    return {
        "without_compiles": stats(quiet[5:]),
        "while_compiling": stats(busy) if busy else None,
        "compiles": compiler.num_compiled,
        "mean_compile_ms": 1e3 * compiler.compile_seconds / max(compiler.num_compiled, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="directory holding config.json")
    parser.add_argument("--tokenizer", default=str(DEMO_TOKENIZER))
    parser.add_argument("--device", default=None)
    parser.add_argument("--small", action="store_true", help="CPU-sized workload")
    parser.add_argument("--output", default=None, help="write the JSON report here")
    args = parser.parse_args()
    small = args.small
    num, lo, hi = (16, 16, 64) if small else (256, 100, 1024)
    engine_args: dict[str, Any] = {"max_num_seqs": 16 if small else 256, "max_model_len": 2048}
    if not small:
        engine_args |= {"max_num_batched_tokens": 8192, "kv_cache_memory_bytes": 64_000_000_000}
    llm = LLM(args.config, tokenizer=args.tokenizer, load_format="dummy", device=args.device,
              enable_prefix_caching=False, **engine_args)  # fmt: skip
    vocab = llm.config.model.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab, n).tolist() for n in rng.integers(lo, hi + 1, num)]
    outputs = rng.integers(lo, hi + 1, num).tolist()
    report: dict[str, Any] = {"config": args.config, "tokenizer": args.tokenizer}
    report["free"] = throughput(llm, prompts, outputs, None)
    report["json_schema"] = throughput(llm, prompts, outputs, RECORD)
    report["json_vs_free"] = report["json_schema"]["output_tok_s"] / report["free"]["output_tok_s"]
    report["ttft"] = ttft(llm, prompts[0][:128], repeats=3)
    # Once to warm up what a first mixed step of these shapes compiles or allocates (the H200
    # run's first call showed one 330 ms step), then measured, with new schemas each time.
    steps_while_compiling(llm, prompts[: 8 if small else 64], 4, salt=4000)
    report["step_time"] = steps_while_compiling(llm, prompts[: 8 if small else 64], 4)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    free, constrained = report["free"], report["json_schema"]
    print(
        f"structured: free {free['output_tok_s']:,.0f} tok/s, json schema "
        f"{constrained['output_tok_s']:,.0f} tok/s ({100 * report['json_vs_free']:.1f}%); "
        f"TTFT +{1e3 * report['ttft']['added_by_compile_s']:.1f} ms new schema, "
        f"+{1e3 * report['ttft']['added_when_cached_s']:.1f} ms cached; step median "
        f"{report['step_time']['without_compiles']['median_ms']:.2f} ms quiet vs "
        f"{(report['step_time']['while_compiling'] or {}).get('median_ms', float('nan')):.2f} ms "
        "while compiling"
    )


if __name__ == "__main__":
    main()
