"""The `tokenmill` command line: `tokenmill generate` (and, as they land, serve/chat/bench)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
from collections.abc import Sequence
from typing import Any, get_args, get_type_hints

from tokenmill import __version__
from tokenmill.config import DEMO_MODEL_DIR, EngineArgs
from tokenmill.sampling_params import SamplingParams

MODEL_HELP = (
    "Hugging Face checkpoint directory (default: the embedded demo model, a 15.7 M parameter "
    "Llama trained on the Python and Django documentation)."
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per `EngineArgs` field (except the model), with that field's help."""
    hints = get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            group.add_argument(
                flag,
                type=kind,
                default=f.default,
                choices=f.metadata.get("choices"),
                help=help_text,
            )


def _base_type(hint: Any) -> type:
    """`int | None` → int."""
    if isinstance(hint, types.UnionType):
        return next(a for a in get_args(hint) if a is not type(None))
    return hint


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` named by parsed flags."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt.")
    group.add_argument(
        "--temperature", type=float, default=0.0, help="Sampling temperature; 0 is greedy."
    )
    group.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    group.add_argument(
        "--top-k", type=int, default=0, help="Sample among the k likeliest; 0 = off."
    )
    group.add_argument(
        "--min-p", type=float, default=0.0, help="Drop tokens below min_p x the max."
    )
    group.add_argument("--sampling-seed", type=int, default=None, help="Per-request seed.")
    group.add_argument("--stop", action="append", default=[], help="Stop string (repeatable).")
    group.add_argument("--ignore-eos", action="store_true", help="Keep going past end-of-sequence.")


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="Logging verbosity (default: INFO).",
    )


def _log_level_anywhere(parser: argparse.ArgumentParser) -> None:
    """Accept `--log-level` after the subcommand too: each leaf parser takes it, and sets it only
    when given (SUPPRESS), so the top-level default stands otherwise."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        if not any("--log-level" in a.option_strings for a in parser._actions):
            _add_log_level(parser, argparse.SUPPRESS)
        return
    for sub in actions[0].choices.values():
        _log_level_anywhere(sub)


def build_parser() -> argparse.ArgumentParser:
    """The `tokenmill` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="tokenmill: a small, fast, observable LLM inference engine."
    )
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    _add_log_level(parser, "INFO")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="Complete prompts offline and print the completions.",
        description="Complete each prompt with the model and print one completion per prompt.",
    )
    gen.add_argument("--model", default=str(DEMO_MODEL_DIR), help=MODEL_HELP)
    gen.add_argument("prompts", nargs="+", help="Prompt texts.")
    gen.add_argument(
        "--chat", action="store_true", help="Send each prompt as a user message (chat template)."
    )
    _add_sampling_args(gen)
    add_engine_args(gen)
    chat = commands.add_parser(
        "chat",
        help="Talk to the model in the terminal (its chat template, history kept).",
        description="Reads one user message per line from standard input and prints each "
        "reply; the conversation so far is re-sent every turn (the prefix cache makes that "
        "cheap). An empty line or end of input quits.",
    )
    chat.add_argument("--model", default=str(DEMO_MODEL_DIR), help=MODEL_HELP)
    chat.add_argument("--system", default=None, help="System prompt.")
    _add_sampling_args(chat)
    add_engine_args(chat)
    srv = commands.add_parser(
        "serve",
        help="Serve the OpenAI-compatible HTTP API.",
        description="Serve /v1/completions, /v1/chat/completions and friends over HTTP.",
    )
    srv.add_argument("model", nargs="?", default=str(DEMO_MODEL_DIR), help=MODEL_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    srv.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    srv.add_argument(
        "--served-model-name", default=None, help="Model name clients use (default: the path)."
    )
    srv.add_argument(
        "--num-tokenizer-workers", type=int, default=1, help="Tokenizer processes (default: 1)."
    )
    srv.add_argument(
        "--trace-file", default=None,
        help="Append one JSON line per finished request (token ids, timestamps, params) here.",
    )  # fmt: skip
    srv.add_argument(
        "--log-requests", action="store_true", help="Log a one-line summary of each request."
    )
    srv.add_argument(
        "--enable-profiling", action="store_true",
        help="Allow POST /start_profile and /stop_profile (torch profiler of the engine core).",
    )  # fmt: skip
    srv.add_argument(
        "--profile-dir", default="tokenmill-profiles",
        help="Where /stop_profile writes the Chrome trace (default: ./tokenmill-profiles).",
    )  # fmt: skip
    add_engine_args(srv)
    _add_bench_parser(commands)
    for sub in commands.choices.values():
        _log_level_anywhere(sub)
    return parser


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="Benchmarks (see ../shared/BENCHMARKS.md).")
    kinds = bench.add_subparsers(dest="bench", required=True)
    offline = kinds.add_parser(
        "offline",
        help="B1 (single-stream decode) or B2 (offline throughput) on dummy weights.",
        description="Runs B1 or B2 of BENCHMARKS.md on random weights built from a config "
        "directory, with the roofline (bandwidth and matmul rate measured in the same run) and "
        "the transformers peer measured in the same run.",
    )
    roofline = kinds.add_parser(
        "roofline", help="Print the hardware floor of a config and a workload."
    )
    for p in (offline, roofline):
        p.add_argument("--config", required=True, help="Directory holding config.json.")
        p.add_argument("--workload", choices=("b1", "b2"), default="b1", help="B1 or B2.")
        p.add_argument("--dtype", default="bfloat16", help="Weight dtype (default: bfloat16).")
        p.add_argument("--input-len", type=int, default=512, help="B1 prompt tokens.")
        p.add_argument("--output-len", type=int, default=256, help="B1 output tokens.")
        p.add_argument("--num-requests", type=int, default=256, help="B2 requests.")
        p.add_argument("--min-len", type=int, default=100, help="B2 shortest input/output.")
        p.add_argument("--max-len", type=int, default=1024, help="B2 longest input/output.")
        p.add_argument("--seed", type=int, default=0, help="Seed for lengths and token ids.")
    _add_serve_bench_parser(kinds)
    offline.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present).")
    offline.add_argument("--no-peer", action="store_true", help="Skip the transformers peer.")
    offline.add_argument(
        "--peer-requests", type=int, default=32, help="B2: requests the peer runs (it is slow)."
    )
    offline.add_argument("--output", default=None, help="Write the full report as JSON here.")
    offline.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
        help="Extra engine option, e.g. max_num_seqs=256 (repeatable).",
    )  # fmt: skip


def _add_serve_bench_parser(kinds: argparse._SubParsersAction) -> None:
    from tokenmill.bench.workloads import WORKLOADS

    serve = kinds.add_parser(
        "serve",
        help="Load-test an OpenAI-compatible server with a workload profile.",
        description="Streams /v1/completions (token-id prompts) against any OpenAI-compatible "
        "server and reports TTFT, ITL, TPOT and E2E percentiles, throughput and goodput.",
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server address.")
    serve.add_argument("--model", required=True, help="Model name the server serves.")
    serve.add_argument("--workload", choices=WORKLOADS, default="random", help="Traffic profile.")
    arrivals = serve.add_mutually_exclusive_group()
    arrivals.add_argument(
        "--request-rate", type=float, default=float("inf"),
        help="Sessions started per second (Poisson; default: all at once).",
    )  # fmt: skip
    arrivals.add_argument(
        "--sweep-rates", default=None, help="Comma-separated rates to run in turn, e.g. 1,2,4,8."
    )
    serve.add_argument(
        "--burstiness", type=float, default=1.0, help="Gamma shape of arrivals (1 = Poisson)."
    )
    serve.add_argument("--max-concurrency", type=int, default=None, help="Cap on open requests.")
    serve.add_argument(
        "--num-requests", type=int, default=16,
        help="Sessions to run (one request each, several for chatbot/agent).",
    )  # fmt: skip
    serve.add_argument("--duration", type=float, default=None, help="Stop starting after S s.")
    serve.add_argument("--seed", type=int, default=0, help="Seed of lengths, ids, arrivals.")
    serve.add_argument("--slo", default=None, help="Goodput SLO, e.g. ttft:500,itl:50 (ms).")
    serve.add_argument("--input-len", type=int, default=512, help="random: prompt tokens.")
    serve.add_argument("--output-len", type=int, default=128, help="random: output tokens.")
    serve.add_argument("--prefix-len", type=int, default=None, help="Shared prefix tokens.")
    serve.add_argument(
        "--length-scale", type=float, default=1.0, help="Scale every length (small models)."
    )
    serve.add_argument(
        "--vocab-size", type=int, default=None,
        help="Token ids are drawn below this (default: the server's, else 32000).",
    )  # fmt: skip
    serve.add_argument("--output", default=None, help="Write the JSON report (every request).")
    serve.add_argument("--plot", default=None, help="Write PNG charts here.")


def _parse_slo(text: str | None) -> tuple[float | None, float | None]:
    if not text:
        return None, None
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, ms = part.partition(":")
        if key not in ("ttft", "itl") or not sep:
            raise ValueError(f"--slo must look like ttft:500,itl:50 (ms), got {text!r}")
        values[key] = float(ms) / 1e3
    return values.get("ttft"), values.get("itl")


def _serve_bench(ns: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import json

    import httpx

    from tokenmill.bench import plots
    from tokenmill.bench.serve import ServeBenchArgs, format_table, run_serve_bench
    from tokenmill.bench.workloads import WorkloadSpec

    vocab = ns.vocab_size
    if vocab is None:
        cards = httpx.get(ns.base_url + "/v1/models", timeout=30).json().get("data", [])
        vocab = next((c["vocab_size"] for c in cards if "vocab_size" in c), 32000)
    spec = WorkloadSpec(
        name=ns.workload, num_sessions=ns.num_requests, vocab_size=vocab, seed=ns.seed,
        input_len=ns.input_len, output_len=ns.output_len, prefix_len=ns.prefix_len,
        length_scale=ns.length_scale,
    )  # fmt: skip
    slo_ttft, slo_itl = _parse_slo(ns.slo)
    base = ServeBenchArgs(
        base_url=ns.base_url, model=ns.model, workload=spec, request_rate=ns.request_rate,
        burstiness=ns.burstiness, max_concurrency=ns.max_concurrency, duration=ns.duration,
        slo_ttft=slo_ttft, slo_itl=slo_itl,
    )  # fmt: skip
    rates = [float(r) for r in ns.sweep_rates.split(",")] if ns.sweep_rates else [ns.request_rate]
    reports = []
    for rate in rates:
        report = asyncio.run(run_serve_bench(dataclasses.replace(base, request_rate=rate)))
        print(format_table(report))
        reports.append(report)
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump(reports if len(reports) > 1 else reports[0], f, indent=2)
    if ns.plot:
        if len(reports) > 1:
            plots.plot_sweep(reports, ns.plot)
        else:
            plots.plot_report(reports[0], ns.plot)
    return 0 if all(r["failed"] == 0 for r in reports) else 1


def _engine_kwargs(pairs: list[str]) -> dict[str, object]:
    hints = get_type_hints(EngineArgs)
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in hints:
            raise ValueError(
                f"--engine-arg must be KEY=VALUE with KEY an engine option, got {pair!r}"
            )
        kind = _base_type(hints[key])
        out[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return out


def _bench(ns: argparse.Namespace) -> int:
    import numpy as np

    from tokenmill.bench import offline, roofline
    from tokenmill.config import ModelConfig

    if ns.bench == "serve":
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return _serve_bench(ns)
    if ns.bench == "roofline":
        cfg = ModelConfig.from_pretrained(ns.config, ns.dtype)
        cost = roofline.ModelCost.of(cfg, 2 if ns.dtype != "float32" else 4)
        hw = roofline.Hardware(roofline.H200_COPY_BANDWIDTH, roofline.H200_MATMUL_FLOPS)
        if ns.workload == "b1":
            floor = roofline.single_stream_floor(cost, ns.input_len, ns.output_len, hw)
            print(f"B1 floor: {floor * 1e3:.3f} ms per output token = {1 / floor:.0f} tok/s")
        else:
            rng = np.random.default_rng(ns.seed)
            p = rng.integers(ns.min_len, ns.max_len + 1, ns.num_requests)
            o = rng.integers(ns.min_len, ns.max_len + 1, ns.num_requests)
            ideal = roofline.batch_floor(cost, p, o, hw)
            print(f"B2 ideal: {ideal:.2f} s = {o.sum() / ideal:.0f} output tok/s")
        print(f"(weights read by a one-token step: {cost.weight_bytes(1) / 1e9:.2f} GB; "
              f"{hw.bandwidth / 1e12:.2f} TB/s, {hw.matmul_flops / 1e12:.0f} TFLOP/s)")  # fmt: skip
        return 0
    args = offline.OfflineBenchArgs(
        config=ns.config, workload=ns.workload, dtype=ns.dtype, device=ns.device,
        num_requests=ns.num_requests, input_len=ns.input_len, output_len=ns.output_len,
        min_len=ns.min_len, max_len=ns.max_len, seed=ns.seed, peer=not ns.no_peer,
        peer_requests=ns.peer_requests, engine_kwargs=_engine_kwargs(ns.engine_arg),
    )  # fmt: skip
    report = offline.run_offline(args)
    offline.write_report(report, ns.output)
    for row in offline.summary_rows(report):
        print(row)
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.api_server import ServeArgs, serve

    args = ServeArgs(
        engine=engine_args_from(ns),
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        num_tokenizer_workers=ns.num_tokenizer_workers,
        log_level=ns.log_level,
        trace_file=ns.trace_file,
        log_requests=ns.log_requests,
        enable_profiling=ns.enable_profiling,
        profile_dir=ns.profile_dir,
    )
    return serve(args)


def _sampling_params(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )


def _chat(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    params = _sampling_params(ns)  # bad sampling options fail before the model loads
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(f"assistant: {reply}", flush=True)
    return 0


def _generate(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    params = _sampling_params(ns)  # bad sampling options fail before the model loads
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    if ns.chat:
        chats = [[{"role": "user", "content": p}] for p in ns.prompts]
        outputs = llm.chat(chats, params, use_tqdm=False)
    else:
        outputs = llm.generate(list(ns.prompts), params, use_tqdm=False)
    for prompt, out in zip(ns.prompts, outputs, strict=True):
        completion = out.outputs[0]
        print(f"=== {prompt!r} ({completion.finish_reason}, {len(completion.token_ids)} tokens)")
        print(completion.text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tokenmill` console script."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        handlers = {"serve": _serve, "generate": _generate, "chat": _chat, "bench": _bench}
        return handlers[ns.command](ns)
    except ValueError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
