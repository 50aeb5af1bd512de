"""`tokenmill eval tasks`: a task file run against a live server, every answer scored.

Each task is one streamed request (greedy unless the task sets a temperature) with its token ids
returned; its result keeps the response id (to find its trace, or to send feedback on it), the
server's prompt token ids (`/tokenize`), the output token ids, and TTFT and latency.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from tokenmill.evals.client import EvalClient, EvalRequestError
from tokenmill.evals.options import TaskEvalArgs, default_api_key
from tokenmill.evals.scorers import DEMO_TASKS, SCORERS, Task, load_tasks, score


async def _run_one(client: EvalClient, task: Task, args: TaskEvalArgs) -> dict[str, Any]:
    result: dict[str, Any] = {"id": task.id, "scorer": task.scorer, "expected": task.expected}
    params: dict[str, Any] = {
        "max_tokens": task.max_tokens or args.max_tokens,
        "temperature": task.temperature,
    }
    if task.stop:
        params["stop"] = task.stop
    try:
        prompt_ids = await client.tokenize(task.prompt, task.messages)
        out = await client.generate(task.prompt, task.messages, top_logprobs=0, **params)
    except (EvalRequestError, httpx.HTTPError) as exc:  # e.g. this request timed out
        return {**result, "passed": False, "error": str(exc) or type(exc).__name__}
    passed, detail = score(task, out.text)
    return {
        **result,
        "passed": passed,
        "detail": detail,
        "answer": out.text,
        "request_id": out.request_id,
        "prompt_token_ids": prompt_ids,
        "output_token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "cached_tokens": out.cached_tokens,
        "ttft_s": out.ttft_s,
        "latency_s": out.latency_s,
    }


async def _run_all(args: TaskEvalArgs, tasks: list[Task]) -> tuple[str, list[dict[str, Any]]]:
    async with EvalClient(args.base_url, args.api_key or default_api_key(), args.timeout) as client:
        card = await client.model_card(args.served_model_name)
        limit = asyncio.Semaphore(args.concurrency)
        bar = tqdm(total=len(tasks), desc="tasks", unit="task", disable=not args.progress)

        async def run(task: Task) -> dict[str, Any]:
            async with limit:
                result = await _run_one(client, task, args)
            bar.update(1)
            bar.set_postfix_str(f"{task.id}: {'pass' if result['passed'] else 'FAIL'}")
            return result

        try:
            results = await asyncio.gather(*(run(t) for t in tasks))
        finally:
            bar.close()
    return card["id"], list(results)


def run_tasks(args: TaskEvalArgs, path: str | None) -> dict[str, Any]:
    """Run the tasks of `path` (default: the built-in demo tasks); the report."""
    file = Path(path) if path else DEMO_TASKS
    tasks = load_tasks(file)
    model, results = asyncio.run(_run_all(args, tasks))
    num_passed = sum(r["passed"] for r in results)
    errors = sum("error" in r for r in results)
    accuracy = num_passed / len(results)
    by_scorer = {}
    for name in SCORERS:
        chosen = [r for r in results if r["scorer"] == name]
        if chosen:
            by_scorer[name] = {"tasks": len(chosen), "passed": sum(r["passed"] for r in chosen)}
    latencies = [r["latency_s"] for r in results if "latency_s" in r]
    return {
        "passed": accuracy >= args.min_accuracy and errors == 0,
        "file": str(file),
        "base_url": args.base_url,
        "served_model": model,
        "num_tasks": len(results),
        "num_passed": num_passed,
        "num_errors": errors,
        "accuracy": accuracy,
        "min_accuracy": args.min_accuracy,
        "by_scorer": by_scorer,
        "mean_latency_s": sum(latencies) / len(latencies) if latencies else None,
        "finish_reasons": dict(Counter(r.get("finish_reason") for r in results)),
        "results": results,
    }


def format_table(report: dict[str, Any], max_failures: int = 10) -> str:
    """Accuracy per scorer and overall, then the first failures."""
    lines = [
        f"tasks of {report['file']} on {report['served_model']} at {report['base_url']}",
        f"{'scorer':<12}{'tasks':>7}{'passed':>8}{'accuracy':>10}",
    ]
    rows = [*report["by_scorer"].items()]
    rows.append(("all", {"tasks": report["num_tasks"], "passed": report["num_passed"]}))
    for name, s in rows:
        lines.append(f"{name:<12}{s['tasks']:>7}{s['passed']:>8}{s['passed'] / s['tasks']:>10.3f}")
    if report["mean_latency_s"] is not None:
        lines.append(f"mean latency {report['mean_latency_s']:.3f} s")
    failed = [r for r in report["results"] if not r["passed"]]
    for r in failed[:max_failures]:
        why = r.get("error") or f"{r['detail']}; answer {r['answer'][:60]!r}"
        lines.append(f"FAILED {r['id']} ({r['scorer']}, expected {r['expected']!r}): {why}")
    if len(failed) > max_failures:
        lines.append(f"... and {len(failed) - max_failures} more (see --output)")
    verdict = "PASS" if report["passed"] else "FAIL"
    lines.append(
        f"{verdict}: accuracy {report['accuracy']:.3f} (minimum {report['min_accuracy']}), "
        f"{report['num_errors']} request errors"
    )
    return "\n".join(lines)
