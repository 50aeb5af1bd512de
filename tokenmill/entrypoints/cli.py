"""The `tokenmill` command line: `tokenmill generate|chat|serve|bench|eval`."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, get_args, get_origin, get_type_hints

from tokenmill import __version__
from tokenmill.config import DEMO_MODEL_DIR, EngineArgs
from tokenmill.deploy.options import DeployOptions
from tokenmill.entrypoints.server_options import ServerOptions
from tokenmill.entrypoints.stop_signals import Stopped, stop_on_signals
from tokenmill.sampling_params import SamplingDefaults, SamplingParams

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM

if TYPE_CHECKING:
    from tokenmill.bench.options import OfflineBenchArgs

T = TypeVar("T")
logger = logging.getLogger(__name__)

MODEL_HELP = (
    "Hugging Face checkpoint directory (default: the embedded demo model, a 15.7 M parameter "
    "Llama trained on the Python and Django documentation)."
)


def add_options(
    parser: argparse.ArgumentParser, cls: type, title: str, skip: Sequence[str] = ()
) -> None:
    """One `--flag` per field of dataclass `cls` (except `skip`), in an argument group `title`,
    with the field's `help` metadata (`config.option`) and default; a field without a default
    is a required flag, a bool one is `--flag/--no-flag`.

    More metadata: `default_help` (shown instead of the default), `negation` (an extra flag that
    sets a bool False, e.g. vLLM's `--disable-log-requests`), `alias` (a second spelling, e.g.
    `-tp`); a `tuple[str, ...]` field takes a JSON list or comma-separated text.
    """
    hints = get_type_hints(cls)
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        required = f.default is dataclasses.MISSING
        default = f.metadata.get("default_help", f.default)
        # A help that says its default itself ("(default: cuda if present)") gets no second,
        # "(default: None)", contradicting it.
        said = "(default:" in f.metadata["help"]
        help_text = f.metadata["help"] + ("" if required or said else f" (default: {default})")
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
            if "negation" in f.metadata:
                group.add_argument(
                    f.metadata["negation"], dest=f.name, action="store_false",
                    help=f"Same as --no-{flag[2:]}.",
                )  # fmt: skip
        elif kind is tuple:
            group.add_argument(flag, type=_str_tuple, default=f.default, help=help_text)
        elif required:
            group.add_argument(flag, type=kind, required=True, help=help_text)
        else:
            flags = (flag, f.metadata["alias"]) if "alias" in f.metadata else (flag,)
            group.add_argument(
                *flags, type=kind, default=f.default, choices=f.metadata.get("choices"),
                help=help_text,
            )  # fmt: skip


def options_from(ns: argparse.Namespace, cls: type[T], **extra: Any) -> T:
    """The `cls` named by parsed flags: every field that has a flag, except those given in
    `extra`, which win; the others keep their defaults."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    values = {f.name: getattr(ns, f.name) for f in fields if hasattr(ns, f.name)}
    return cls(**{**values, **extra})


def _str_tuple(text: str) -> tuple[str, ...]:
    """`'["a", "b"]'` or `"a,b"` → ("a", "b")."""
    if text.lstrip().startswith("["):
        values = json.loads(text)
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return tuple(values)
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per `EngineArgs` field (except the model), with that field's help."""
    add_options(parser, EngineArgs, "engine options", skip=("model",))


def _base_type(hint: Any) -> type:
    """`int | None` → int; `tuple[str, ...]` → tuple."""
    if isinstance(hint, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return get_origin(hint) or hint


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` named by parsed flags."""
    return options_from(ns, EngineArgs)


# The command line's own sampling defaults, below the model's (its generation_config.json):
# greedy, and a short completion (`_offline_llm`: a default max_tokens, at most the room left).
_CLI_SAMPLING = {"temperature": 0.0}
CLI_MAX_TOKENS = 64
# A placard (title, attribution, a paragraph of up to 90 words) fits in this many tokens.
PLACARD_MAX_TOKENS = 256


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling options",
        "An option not given takes the model's value from its generation_config.json (see "
        "--generation-config), else the default shown.",
    )
    group.add_argument(
        "--max-tokens", type=int, default=None,
        help="Tokens to generate per prompt (default: --override-generation-config's or the "
        "model's max_new_tokens, else 64, or 256 for a placard; at most the room left in the "
        "context).",
    )  # fmt: skip
    group.add_argument(
        "--temperature", type=float, default=None, help="Sampling temperature; 0 is greedy "
        "(default: 0).",
    )  # fmt: skip
    group.add_argument(
        "--top-p", type=float, default=None, help="Nucleus sampling mass (default: 1)."
    )
    group.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="Sample among the k likeliest; 0 = off (default: 0).",
    )
    group.add_argument(
        "--min-p", type=float, default=None, help="Drop tokens below min_p x the max (default: 0)."
    )
    group.add_argument(
        "--repetition-penalty", type=float, default=None,
        help="Divide the logits of tokens already in the prompt or output by this (> 1 repeats "
        "less; default: 1).",
    )  # fmt: skip
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
        description="Reads one user message per line at the '> ' prompt and prints the reply "
        "as it is generated; the conversation so far is re-sent every turn (the prefix cache "
        "makes that cheap). Ctrl-C stops a reply and returns to the prompt; an empty line, "
        "end of input (Ctrl-D) or Ctrl-C at the prompt quits.",
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
    srv.add_argument(
        "model_dir", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP + " Or --model."
    )
    srv.add_argument("--model", default=None, help="The checkpoint directory (as the positional).")
    add_options(srv, ServerOptions, "server options")
    add_options(srv, DeployOptions, "replica options (Ray Serve; pip install 'tokenmill[ray]')")
    add_engine_args(srv)
    placard = commands.add_parser(
        "placard",
        help="Write a museum placard for each image (a vision-language model, e.g. Qwen3-VL).",
        description="Asks the model to write the placard that would hang beside each image in "
        "a museum (title; artist, medium, year; a short description) and prints them.",
    )
    placard.add_argument("images", nargs="+", metavar="IMAGE", help="Image files (PNG, JPEG...).")
    placard.add_argument(
        "--model", required=True,
        help="A vision-language checkpoint directory (Qwen3-VL or Qwen3-VL-MoE).",
    )  # fmt: skip
    placard.add_argument(
        "--prompt", default=None, help="The instruction sent with each image (default: the "
        "curator's placard request, tokenmill.entrypoints.placard.PLACARD_PROMPT).",
    )  # fmt: skip
    _add_sampling_args(placard)
    add_engine_args(placard)
    _add_bench_parser(commands)
    _add_eval_parser(commands)
    for sub in commands.choices.values():
        _log_level_anywhere(sub)
    return parser


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    from tokenmill.bench.options import B4_OPTIONS, OfflineBenchArgs

    bench = commands.add_parser("bench", help="Benchmarks: B1/B2 offline, roofline, serving load.")
    kinds = bench.add_subparsers(dest="bench", required=True)
    offline = kinds.add_parser(
        "offline",
        help="B1 (single-stream decode), B2 (offline throughput), B4, B6 (prefill) or the data "
        "workload on dummy weights.",
        description="Runs B1, B2, B4 or B6 of BENCHMARKS.md, or the serving benchmark's data "
        "workload through LLM.generate, on random weights built from a config directory, with "
        "the roofline (bandwidth and matmul rate measured in the same run; B6 and data report "
        "the share of the matmul rate their FLOPs, attention included, used) and, for B1 and "
        "B2, the transformers peer measured in the same run.",
    )
    add_options(offline, OfflineBenchArgs, "benchmark options", skip=("engine_kwargs",))
    offline.add_argument("--output", default=None, help="Write the full report as JSON here.")
    offline.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
        help="Extra engine option, e.g. max_num_seqs=256 (repeatable).",
    )  # fmt: skip
    roofline = kinds.add_parser(
        "roofline", help="Print the hardware floor of a config and a workload."
    )
    # Only for a run, or only B4's (which has no roofline): not flags here, so not ignored.
    machine = ("device", "peer", "peer_requests", "engine_kwargs", *B4_OPTIONS)
    add_options(roofline, OfflineBenchArgs, "benchmark options", skip=machine)
    _add_serve_bench_parser(kinds)


def _add_serve_bench_parser(kinds: argparse._SubParsersAction) -> None:
    from tokenmill.bench.options import ServeBenchArgs
    from tokenmill.bench.workloads import WORKLOADS, WorkloadSpec

    serve = kinds.add_parser(
        "serve",
        help="Load-test an OpenAI-compatible server with a workload profile.",
        description="Streams /v1/completions (token-id prompts) against any OpenAI-compatible "
        "server and reports TTFT, ITL, TPOT and E2E percentiles, throughput and goodput.",
    )
    serve.add_argument(
        "--base-url", default="http://127.0.0.1:8000",
        help="Server address (default: http://127.0.0.1:8000).",
    )  # fmt: skip
    serve.add_argument(
        "--workload", choices=WORKLOADS, default="random",
        help="Traffic profile (BENCHMARKS.md B3): random (--input-len prompts, --output-len "
        "outputs), shared-prefix (the same with one of --num-prefixes shared prefixes first), "
        "chatbot (2-6 turns after a shared system prompt), agent (10-20 turns after a long "
        "shared prefix) or data (2,000-8,000-token documents, short outputs) (default: random).",
    )  # fmt: skip
    arrivals = serve.add_mutually_exclusive_group()
    arrivals.add_argument(
        "--request-rate", type=float, default=float("inf"),
        help="Sessions started per second (Poisson; default: all at once).",
    )  # fmt: skip
    arrivals.add_argument(
        "--sweep-rates", default=None, help="Comma-separated rates to run in turn, e.g. 1,2,4,8."
    )
    # Set by the flags above and below, or made of several: --slo gives both SLOs.
    manual = ("base_url", "workload", "request_rate", "slo_ttft", "slo_itl")
    add_options(serve, ServeBenchArgs, "load options", skip=manual)
    serve.add_argument("--slo", default=None, help="Goodput SLO, e.g. ttft:500,itl:50 (ms).")
    serve.add_argument(
        "--num-requests", type=int, default=16,
        help="Sessions to run (one request each, several for chatbot/agent) (default: 16).",
    )  # fmt: skip
    serve.add_argument(
        "--vocab-size", type=int, default=None,
        help="Token ids are drawn below this (default: the server's, else 32000).",
    )  # fmt: skip
    add_options(
        serve, WorkloadSpec, "workload options", skip=("name", "num_sessions", "vocab_size")
    )
    serve.add_argument("--output", default=None, help="Write the JSON report (every request).")
    serve.add_argument("--plot", default=None, help="Write PNG charts here.")


def _add_eval_parser(commands: argparse._SubParsersAction) -> None:
    from tokenmill.evals.cli import add_eval_parser

    add_eval_parser(commands)


def _eval(ns: argparse.Namespace) -> int:
    from tokenmill.evals.cli import run_eval

    return run_eval(ns)


def _parse_slo(text: str | None) -> tuple[float | None, float | None]:
    """`--slo ttft:500,itl:50` as (TTFT, ITL) in seconds; each a finite number of ms > 0."""
    if not text:
        return None, None
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, ms = part.partition(":")
        if key not in ("ttft", "itl") or not sep:
            raise ValueError(f"--slo must look like ttft:500,itl:50 (ms), got {text!r}")
        values[key] = _float("--slo", ms) / 1e3
        if not 0 < values[key] < float("inf"):  # NaN too: no request would meet it
            raise ValueError(f"--slo {key} must be a number of ms > 0, got {ms!r}")
    return values.get("ttft"), values.get("itl")


def _check_output(flag: str, path: str | None) -> None:
    """A file `flag` names can be written: checked before a benchmark runs, not after it (an
    `open` traceback at the end of a run, its report lost)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path!r}: not a file in a writable directory")


def _float(flag: str, text: str) -> float:
    """`text` as a number; `ValueError` naming `flag` (float's own message names nothing)."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} takes numbers, got {text!r}") from None


def _serve_bench(ns: argparse.Namespace) -> int:
    import asyncio
    import json

    import httpx

    from tokenmill.bench import plots
    from tokenmill.bench.options import ServeBenchArgs
    from tokenmill.bench.serve import format_table, run_serve_bench
    from tokenmill.bench.workloads import WorkloadSpec

    slo_ttft, slo_itl = _parse_slo(ns.slo)
    _check_output("--output", ns.output)
    _check_output("--plot", ns.plot)
    if ns.sweep_rates is not None:
        rates = [_float("--sweep-rates", r) for r in ns.sweep_rates.split(",")]
    else:
        rates = [ns.request_rate]
    vocab = ns.vocab_size
    if vocab is None:
        try:
            cards = httpx.get(ns.base_url + "/v1/models", timeout=30).json().get("data", [])
        except (httpx.HTTPError, ValueError) as exc:  # unreachable, or not a JSON answer
            raise ValueError(
                f"--base-url {ns.base_url}: cannot read /v1/models for the vocabulary size "
                f"({exc}); is the server up? (or give --vocab-size)"
            ) from None
        vocab = next((c["vocab_size"] for c in cards if "vocab_size" in c), 32000)
    spec = options_from(
        ns, WorkloadSpec, name=ns.workload, num_sessions=ns.num_requests, vocab_size=vocab
    )
    base = options_from(
        ns, ServeBenchArgs, base_url=ns.base_url, workload=spec, slo_ttft=slo_ttft,
        slo_itl=slo_itl,
    )  # fmt: skip
    runs = [dataclasses.replace(base, request_rate=rate) for rate in rates]  # all checked first
    reports = []
    for run in runs:
        report = asyncio.run(run_serve_bench(run))
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


# `--engine-arg` spellings of a bool option's values.
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _engine_kwargs(pairs: list[str]) -> dict[str, object]:
    """`bench offline --engine-arg KEY=VALUE`s as engine options; `ValueError` naming the flag
    for an unknown key, the model (that is --config), or a value of the wrong type (a bool
    option's too: anything but true/false and their spellings was False before)."""
    hints = get_type_hints(EngineArgs)
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in hints or key == "model":
            raise ValueError(
                f"--engine-arg must be KEY=VALUE with KEY an engine option (not model: that is "
                f"--config), got {pair!r}"
            )
        kind = _base_type(hints[key])
        try:
            out[key] = _bool(value) if kind is bool else kind(value)
        except ValueError:
            raise ValueError(
                f"--engine-arg {key} takes {getattr(kind, '__name__', kind)} values, got {value!r}"
            ) from None
    return out


def _bool(text: str) -> bool:
    """`text` as a bool (true/false, yes/no, on/off, 1/0); `ValueError` for anything else."""
    if text.lower() not in (*_TRUE, *_FALSE):
        raise ValueError(text)
    return text.lower() in _TRUE


def _bench(ns: argparse.Namespace) -> int:
    import numpy as np

    from tokenmill.bench import offline, roofline
    from tokenmill.bench.options import OfflineBenchArgs
    from tokenmill.bench.workloads import build_workload
    from tokenmill.config import ModelConfig

    if ns.bench == "serve":
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return _serve_bench(ns)
    if ns.bench == "roofline":
        args = options_from(ns, OfflineBenchArgs)
        if args.workload == "b4":
            raise ValueError("bench roofline has no b4 floor; use b1, b2, b6 or data")
        cfg = ModelConfig.from_pretrained(args.config, args.dtype)
        cost = roofline.ModelCost.of(cfg, 2 if args.dtype != "float32" else 4)
        hw = roofline.Hardware(roofline.H200_COPY_BANDWIDTH, roofline.H200_MATMUL_FLOPS)
        if args.workload == "b1":
            floor = roofline.single_stream_floor(cost, args.input_len, args.output_len, hw)
            print(f"B1 floor: {floor * 1e3:.3f} ms per output token = {1 / floor:.0f} tok/s")
        elif args.workload == "b6":
            prompts = np.full(args.num_requests, args.input_len)
            floor = cost.prefill_time(prompts, hw)
            print(f"B6 floor: {floor:.3f} s = {prompts.sum() / floor:.0f} prompt tok/s")
        elif args.workload == "data":
            turns = [s.turns[0] for s in build_workload(offline.data_workload(args, cfg))]
            p = np.array([len(t.new_tokens) for t in turns])
            o = np.array([t.max_tokens for t in turns])
            floor = cost.sequence_flops(p, o) / hw.matmul_flops
            tok_s = (p + o).sum() / floor
            print(f"data at the matmul rate: {floor:.2f} s = {tok_s:.0f} total tok/s")
        else:
            rng = np.random.default_rng(args.seed)
            p = rng.integers(args.min_len, args.max_len + 1, args.num_requests)
            o = rng.integers(args.min_len, args.max_len + 1, args.num_requests)
            ideal = roofline.batch_floor(cost, p, o, hw)
            print(f"B2 ideal: {ideal:.2f} s = {o.sum() / ideal:.0f} output tok/s")
        print(f"(weights read by a one-token step: {cost.weight_bytes(1) / 1e9:.2f} GB; "
              f"{hw.bandwidth / 1e12:.2f} TB/s, {hw.matmul_flops / 1e12:.0f} TFLOP/s)")  # fmt: skip
        return 0
    args = options_from(ns, OfflineBenchArgs, engine_kwargs=_engine_kwargs(ns.engine_arg))
    _check_output("--output", ns.output)
    if args.workload == "b4":
        return _spec_bench(args, ns.output)
    report = offline.run_offline(args)
    offline.write_report(report, ns.output)
    for row in offline.summary_rows(report):
        print(row)
    return 0


def _spec_bench(args: OfflineBenchArgs, output: str | None) -> int:
    from tokenmill.bench import speculative
    from tokenmill.bench.offline import write_report

    report = speculative.run_b4(speculative.SpecBenchArgs.of(args))
    write_report(report, output)
    for row in speculative.summary_rows(report):
        print(row)
    return 0


def _serve(ns: argparse.Namespace) -> int:
    # Before anything starts: a SIGTERM from here on stops the server cleanly.
    with stop_on_signals():
        try:
            return _serve_model(ns)
        except (KeyboardInterrupt, Stopped) as exc:  # before (or after) uvicorn took signals
            _exit_stopped(exc)


def _exit_stopped(exc: KeyboardInterrupt | Stopped) -> NoReturn:
    code, why = (130, "interrupted") if isinstance(exc, KeyboardInterrupt) else (0, str(exc))
    print(f"tokenmill: {why}", file=sys.stderr, flush=True)
    # The clean-ups have run. An import the signal cut short on this thread can leave its
    # module's lock held for good, and the thread loading the tokenizer waiting for it: exiting
    # normally would join that thread forever.
    logging.shutdown()
    os._exit(code)


def _serve_model(ns: argparse.Namespace) -> int:
    if ns.model and ns.model_dir and ns.model != ns.model_dir:
        raise ValueError(f"two models given: {ns.model_dir!r} and --model {ns.model!r}")
    ns.model = ns.model or ns.model_dir or str(DEMO_MODEL_DIR)
    options = options_from(ns, ServerOptions)
    deploy = options_from(ns, DeployOptions)
    if deploy.enabled:
        return _serve_replicas(engine_args_from(ns), options, deploy)
    from tokenmill.entrypoints.early_start import start_early

    # The engine core, the fork server, the detokenizer and the tokenizer workers start first:
    # their imports and the model's loading run beside the api server's (seconds each).
    engine = engine_args_from(ns)
    early = start_early(engine, options.num_tokenizer_workers, options.chat_template, ns.log_level)
    try:
        from tokenmill.entrypoints.api_server import serve

        code = serve(engine, options, ns.log_level, early)
    finally:
        early.stop()  # the server stopped them, unless it failed before adopting them
    # The interpreter's last garbage collections walk every object torch and transformers made,
    # seconds on a busy machine while an orchestrator waits for the exit code; exiting, nothing
    # needs collecting.
    gc.freeze()
    return code


def _serve_replicas(engine: EngineArgs, options: ServerOptions, deploy: DeployOptions) -> int:
    try:
        from tokenmill.deploy.app import run
    except ImportError as exc:
        raise ValueError(
            f"--replicas needs Ray Serve ({exc}): pip install 'tokenmill[ray]'"
        ) from exc
    return run(engine, options, deploy)


def _sampling_params(ns: argparse.Namespace, defaults: SamplingDefaults) -> SamplingParams:
    """The sampling flags given, `defaults` (the model's) for the others, then the command
    line's own (`_CLI_SAMPLING`)."""
    given = {
        "max_tokens": ns.max_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "min_p": ns.min_p,
        "repetition_penalty": ns.repetition_penalty,
        "seed": ns.sampling_seed,
        "stop": ns.stop,
        "ignore_eos": ns.ignore_eos,
    }
    return defaults.sampling_params(given, _CLI_SAMPLING)


def _offline_llm(ns: argparse.Namespace, max_tokens: int) -> LLM:
    """The `LLM` of `generate`, `chat` and `placard` (bad sampling options refused before the
    model loads). Without --max-tokens, and without a max_new_tokens of the model's or of
    --override-generation-config, `max_tokens` becomes the default one: as the model's own, at
    most the room left in the context (a fixed value made a long prompt fail on a max_tokens the
    user never gave)."""
    from tokenmill.config import load_sampling_defaults, parse_generation_override
    from tokenmill.entrypoints.llm import LLM

    _sampling_params(ns, SamplingDefaults())
    args = engine_args_from(ns)
    override = dict(parse_generation_override(args.override_generation_config))
    unset = ns.max_tokens is None and "max_new_tokens" not in override
    model_defaults = load_sampling_defaults(args.generation_config, args.model, log=False)
    if unset and model_defaults.max_tokens is None:
        override["max_new_tokens"] = max_tokens
        args = dataclasses.replace(args, override_generation_config=override)
    return LLM(**dataclasses.asdict(args))


def _chat(ns: argparse.Namespace) -> int:
    llm = _offline_llm(ns, CLI_MAX_TOKENS)
    params = _sampling_params(ns, llm.config.sampling_defaults)
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history at the prompt)
    print("Ctrl-C stops a reply; an empty line, Ctrl-D or Ctrl-C at the prompt quits.",
          file=sys.stderr)  # fmt: skip
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        logger.debug("chat turn: %d messages", len(messages))
        messages.append({"role": "assistant", "content": _stream_reply(llm, messages, params)})


def _stream_reply(llm: LLM, messages: list[dict[str, Any]], params: SamplingParams) -> str:
    """Print the model's reply as it comes and return it (as far as it got). Ctrl-C stops it
    between engine steps: the handler only raises a flag, so no step is cut in half."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    stream = llm.stream_chat(messages, params)
    text = ""
    try:
        for out in stream:
            print(out.outputs[0].text[len(text) :], end="", flush=True)
            text = out.outputs[0].text
            if stop.is_set():
                break
    finally:
        stream.close()  # aborts the request if it is still running
        signal.signal(signal.SIGINT, previous)
    print(" [interrupted]" if stop.is_set() else "", flush=True)
    return text


def _generate(ns: argparse.Namespace) -> int:
    llm = _offline_llm(ns, CLI_MAX_TOKENS)
    params = _sampling_params(ns, llm.config.sampling_defaults)
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


def _placard(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.placard import PLACARD_PROMPT, write_placards

    missing = [image for image in ns.images if not Path(image).is_file()]
    if missing:
        raise ValueError(f"no such image file: {', '.join(missing)}")
    llm = _offline_llm(ns, PLACARD_MAX_TOKENS)
    params = _sampling_params(ns, llm.config.sampling_defaults)
    outputs = write_placards(llm, ns.images, params, ns.prompt or PLACARD_PROMPT)
    for image, out in zip(ns.images, outputs, strict=True):
        print(f"=== {image}")
        print(out.outputs[0].text.strip())
        print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tokenmill` console script."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        handlers = {
            "serve": _serve, "generate": _generate, "chat": _chat, "bench": _bench, "eval": _eval,
            "placard": _placard,
        }  # fmt: skip
        return handlers[ns.command](ns)
    except ValueError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # e.g. while the model loads: no traceback
        print("tokenmill: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
