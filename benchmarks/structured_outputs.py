"""Structured-output costs: B2-like throughput with a JSON schema on every request vs none, the
time to first token a new schema's compile adds (and a cached one's), and the engine's step time
while schemas compile.

Dummy weights (`load_format=dummy`) of a config-only model directory; the grammar needs a
tokenizer, so one of the model's vocabulary size is built (`tokenmill.testing.large_tokenizer`:
the demo model's byte-level BPE extended with word pieces, the model's EOS ids as special
tokens), unless `--tokenizer` names one. The mask work per token grows with the vocabulary and
with the ids a grammar forbids; a small tokenizer under a large model's ids and EOS (session
11's demo tokenizer under qwen3-0.6b) measures xgrammar's cost of the padding instead.

First, without the engine, the grammar's host cost per row at the benchmark's batch size:
`GrammarMatcher.accept_token` and the mask fill, for rows inside a JSON number and inside a
JSON string, on 1, 2 and 4 Python threads (xgrammar's calls release the GIL: tvm-ffi does
by default). The summary line gives host ms per engine step free vs constrained.

    python benchmarks/structured_outputs.py --config ../shared/models/qwen3-0.6b
    python benchmarks/structured_outputs.py --config ../shared/models/tiny-llama-cpu --small
    python benchmarks/structured_outputs.py --config ../shared/models/qwen3-0.6b --host-only
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.config import ModelConfig
from tokenmill.testing.large_tokenizer import build_large_tokenizer

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


def grammar_host_costs(
    tokenizer: str, model: ModelConfig, rows: int, threads: tuple[int, ...] = (1, 2, 4)
) -> dict[str, Any]:
    """Microseconds per row of the grammar work of one engine step for `rows` requests of the
    RECORD schema, as the engine does it: accept the sampled token, fill the next mask (all
    rows at once, on xgrammar's threads); rows inside a number (`{"id": 12`) and inside a
    string (`..."title": "hello`). Then the same work split over Python threads, in wall time
    per row: it scales only where xgrammar releases the GIL."""
    from tokenmill.structured.compiler import GrammarCompiler
    from tokenmill.structured.matcher import BitmaskFiller, RequestGrammar
    from tokenmill.tokenization.tokenizer import load_tokenizer

    compiler = GrammarCompiler(tokenizer, model.vocab_size, model.eos_token_ids)
    compiled = compiler.submit(StructuredOutputsParams(json=RECORD)).result()
    compiler.shutdown()
    tok = load_tokenizer(tokenizer)
    assert tok is not None
    report: dict[str, Any] = {"grammar_vocab_size": compiled.tokenizer_info.vocab_size}
    # The schema's keys are sorted (StructuredOutputsParams): "tags" comes before "title".
    string = '{"id": 12, "tags": [], "title": "hello'
    states = (("number", '{"id": 12', "3"), ("string", string, " world"))
    for state, prefix, text in states:
        token = tok.encode(text, add_special_tokens=False)[0]

        def fresh(prefix: str = prefix) -> list[RequestGrammar]:
            grammars = [RequestGrammar(compiled) for _ in range(rows)]
            assert all(g.matcher.accept_string(prefix) for g in grammars)
            return grammars

        grammars = fresh()
        filler = BitmaskFiller(grammars[0].vocab_size, pin=False)
        mask = filler.fill(grammars)
        assert mask is not None

        def accept(part: list[RequestGrammar], token: int = token) -> None:
            for g in part:
                assert g.accept_token(token)

        def fill(part: list[int], mask=mask, grammars=grammars) -> None:
            for i in part:
                grammars[i].matcher.fill_next_token_bitmask(mask, i)

        def per_row(run: Callable[[list[RequestGrammar]], object], setup=fresh) -> float:
            best = float("inf")
            for _ in range(5):
                arg = setup()
                start = time.perf_counter()
                run(arg)
                best = min(best, time.perf_counter() - start)
            return 1e6 * best / rows

        result: dict[str, float] = {
            "accept_us": per_row(accept),
            "fill_us": per_row(filler.fill, setup=lambda grammars=grammars: grammars),
            "allowed_tokens": float(np.unpackbits(mask[0].numpy().view(np.uint8)).sum()),
        }
        for n in threads:
            with ThreadPoolExecutor(n) as pool:
                result[f"accept_{n}_threads_us"] = per_row(
                    lambda gs, n=n, pool=pool: list(pool.map(accept, [gs[i::n] for i in range(n)]))
                )
                result[f"fill_{n}_threads_us"] = per_row(
                    lambda parts, pool=pool: list(pool.map(fill, parts)),
                    setup=lambda n=n: [list(range(rows))[i::n] for i in range(n)],
                )
        report[state] = result
    return report


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
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (default: one of the model's vocabulary size, built in a "
        "temporary directory)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--small", action="store_true", help="CPU-sized workload")
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="only the grammar's host cost per row (no model, no engine)",
    )
    parser.add_argument("--output", default=None, help="write the JSON report here")
    args = parser.parse_args()
    small = args.small
    num, lo, hi = (16, 16, 64) if small else (256, 100, 1024)
    model = ModelConfig.from_pretrained(args.config)
    with tempfile.TemporaryDirectory(prefix="tokenmill-tokenizer-") as scratch:
        tokenizer = args.tokenizer or str(
            build_large_tokenizer(scratch, model.vocab_size, model.eos_token_ids)
        )
        report: dict[str, Any] = {"config": args.config, "tokenizer": args.tokenizer or "built"}
        report["grammar_host"] = grammar_host_costs(tokenizer, model, rows=num)
        if not args.host_only:
            report |= engine_report(args, tokenizer, num, lo, hi)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    print(summary(report))


def engine_report(args: argparse.Namespace, tokenizer: str, num: int, lo: int, hi: int) -> dict:
    """Throughput free vs constrained, TTFT of new and cached schemas, steps while compiling."""
    small = args.small
    engine_args: dict[str, Any] = {"max_num_seqs": 16 if small else 256, "max_model_len": 2048}
    if not small:
        engine_args |= {"max_num_batched_tokens": 8192, "kv_cache_memory_bytes": 64_000_000_000}
    llm = LLM(args.config, tokenizer=tokenizer, load_format="dummy", device=args.device,
              enable_prefix_caching=False, **engine_args)  # fmt: skip
    vocab = llm.config.model.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab, n).tolist() for n in rng.integers(lo, hi + 1, num)]
    outputs = rng.integers(lo, hi + 1, num).tolist()
    report: dict[str, Any] = {}
    report["free"] = throughput(llm, prompts, outputs, None)
    report["json_schema"] = throughput(llm, prompts, outputs, RECORD)
    report["json_vs_free"] = report["json_schema"]["output_tok_s"] / report["free"]["output_tok_s"]
    report["ttft"] = ttft(llm, prompts[0][:128], repeats=3)
    # Once to warm up what a first mixed step of these shapes compiles or allocates (the H200
    # run's first call showed one 330 ms step), then measured, with new schemas each time.
    steps_while_compiling(llm, prompts[: 8 if small else 64], 4, salt=4000)
    report["step_time"] = steps_while_compiling(llm, prompts[: 8 if small else 64], 4)
    return report


def summary(report: dict[str, Any]) -> str:
    """One line: throughput, host time per step, the grammar's host cost per row, TTFT."""
    host = report["grammar_host"]
    text, number = host["string"], host["number"]
    line = (
        f"grammar host per row: accept {text['accept_us']:.1f} us, fill {text['fill_us']:.1f} us "
        f"in a string ({number['accept_us']:.1f} / {number['fill_us']:.1f} in a number)"
    )
    if "free" not in report:
        return "structured: " + line
    free, constrained = report["free"], report["json_schema"]
    compiling = report["step_time"]["while_compiling"] or {}
    return (
        f"structured: free {free['output_tok_s']:,.0f} tok/s, json schema "
        f"{constrained['output_tok_s']:,.0f} tok/s ({100 * report['json_vs_free']:.1f}%); "
        f"host ms/step {free['host_ms_per_step']:.2f} free vs "
        f"{constrained['host_ms_per_step']:.2f} constrained; {line}; "
        f"TTFT +{1e3 * report['ttft']['added_by_compile_s']:.1f} ms new schema, "
        f"+{1e3 * report['ttft']['added_when_cached_s']:.1f} ms cached; step median "
        f"{report['step_time']['without_compiles']['median_ms']:.2f} ms quiet vs "
        f"{compiling.get('median_ms', float('nan')):.2f} ms while compiling"
    )


if __name__ == "__main__":
    main()
