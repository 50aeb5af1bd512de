"""The `tokenmill` command line: `tokenmill generate` (and, as they land, serve/chat/bench)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
from collections.abc import Sequence
from typing import Any, get_args, get_type_hints

from tokenmill.config import EngineArgs
from tokenmill.sampling_params import SamplingParams


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="tokenmill: a small, fast, observable LLM inference engine."
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="Logging verbosity (default: INFO).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="Complete prompts offline and print the completions.",
        description="Complete each prompt with the model and print one completion per prompt.",
    )
    gen.add_argument("--model", required=True, help="Hugging Face checkpoint directory.")
    gen.add_argument("prompts", nargs="+", help="Prompt texts.")
    gen.add_argument(
        "--chat", action="store_true", help="Send each prompt as a user message (chat template)."
    )
    _add_sampling_args(gen)
    add_engine_args(gen)
    srv = commands.add_parser(
        "serve",
        help="Serve the OpenAI-compatible HTTP API.",
        description="Serve /v1/completions, /v1/chat/completions and friends over HTTP.",
    )
    srv.add_argument("model", help="Hugging Face checkpoint directory.")
    srv.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    srv.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    srv.add_argument(
        "--served-model-name", default=None, help="Model name clients use (default: the path)."
    )
    srv.add_argument(
        "--num-tokenizer-workers", type=int, default=1, help="Tokenizer processes (default: 1)."
    )
    add_engine_args(srv)
    return parser


def _serve(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.api_server import ServeArgs, serve

    args = ServeArgs(
        engine=engine_args_from(ns),
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        num_tokenizer_workers=ns.num_tokenizer_workers,
        log_level=ns.log_level,
    )
    return serve(args)


def _generate(ns: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )
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
        return _serve(ns) if ns.command == "serve" else _generate(ns)
    except ValueError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
