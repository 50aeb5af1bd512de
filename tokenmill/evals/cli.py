"""`tokenmill eval conformance|tasks|dummy-checkpoint`: the parsers and what each runs."""

from __future__ import annotations

import argparse
import json
import logging


def add_eval_parser(commands: argparse._SubParsersAction) -> None:
    """Register `tokenmill eval` and its subcommands."""
    from tokenmill.entrypoints.cli import add_options
    from tokenmill.evals.options import ConformanceArgs, DummyCheckpointArgs, TaskEvalArgs

    evals = commands.add_parser(
        "eval", help="Evaluate a live deployment: conformance with transformers, task files."
    )
    kinds = evals.add_subparsers(dest="eval", required=True)
    conformance = kinds.add_parser(
        "conformance",
        help="Compare a server's logprobs with transformers on the same checkpoint.",
        description="Sends a fixed prompt set (text of several lengths, token ids, chats, "
        "prefix-cache hits; concurrently) greedily with logprobs, scores the same token ids "
        "with transformers on the checkpoint, and reports top-1 agreement, KL and logprob "
        "errors per position, the server's tokenization and chat template against the "
        "checkpoint's, and the first divergences. Exit status 1 past the thresholds.",
    )
    add_options(conformance, ConformanceArgs, "conformance options")
    _add_outputs(conformance, "Draw top-1 agreement and KL per generated position (PNG).")
    tasks = kinds.add_parser(
        "tasks",
        help="Run a task file (prompts, expected answers, scorers) against a server.",
        description="Each line of FILE is a JSON task: `prompt` (text) or `messages` (a chat), "
        "`expected`, and `scorer`: exact (the answer, stripped, equals expected), regex "
        "(expected is a pattern found in the answer), json_field (the answer is JSON whose "
        "`field`, a dotted path, equals expected) or numeric (the first number in the answer "
        "is within `tolerance` of expected); optional `id`, `max_tokens`, `stop`, "
        "`temperature`. Without FILE, the built-in tasks the demo model passes.",
    )
    tasks.add_argument("file", nargs="?", default=None, metavar="FILE.jsonl", help="Task file.")
    add_options(tasks, TaskEvalArgs, "task options")
    _add_outputs(tasks, None)
    dummy = kinds.add_parser(
        "dummy-checkpoint",
        help="Write random weights for a config as a checkpoint (server and reference load it).",
        description="Random weights (like --load-format dummy) written as safetensors with "
        "config.json and a tokenizer, so that a server and `eval conformance` load the same "
        "numbers.",
    )
    add_options(dummy, DummyCheckpointArgs, "checkpoint options")


def _add_outputs(parser: argparse.ArgumentParser, plot_help: str | None) -> None:
    parser.add_argument("--output", default=None, help="Write the full JSON report here.")
    if plot_help:
        parser.add_argument("--plot", default=None, help=plot_help)


def run_eval(ns: argparse.Namespace) -> int:
    """Run the `tokenmill eval` subcommand `ns` names; its exit status."""
    from tokenmill.entrypoints.cli import options_from

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if ns.eval == "dummy-checkpoint":
        from tokenmill.evals.dummy_checkpoint import write_dummy_checkpoint
        from tokenmill.evals.options import DummyCheckpointArgs

        print(write_dummy_checkpoint(options_from(ns, DummyCheckpointArgs)))
        return 0
    import httpx

    from tokenmill.evals.client import EvalRequestError

    try:
        if ns.eval == "conformance":
            from tokenmill.evals import conformance
            from tokenmill.evals.options import ConformanceArgs

            report = conformance.run_conformance(options_from(ns, ConformanceArgs))
            print(conformance.format_table(report))
            if ns.plot:
                conformance.plot_agreement(report, ns.plot)
        else:
            from tokenmill.evals import tasks
            from tokenmill.evals.options import TaskEvalArgs

            report = tasks.run_tasks(options_from(ns, TaskEvalArgs), ns.file)
            print(tasks.format_table(report))
    except (httpx.HTTPError, EvalRequestError) as exc:  # unreachable, timed out, or refused
        raise ValueError(f"{ns.base_url}: {exc or type(exc).__name__}") from None
    if ns.output:
        with open(ns.output, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["passed"] else 1
