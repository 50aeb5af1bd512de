"""`tokenmill eval conformance`: does a live server compute what its checkpoint computes?

Sends the fixed prompt set (`prompts.py`: text of several lengths, token ids, chats, prefix-cache
hits; concurrently) greedily with logprobs and token ids, then scores the same token ids with
transformers on the same checkpoint (`reference.py`) and compares, per generated position:

- top-1 agreement: the server's greedy token is the reference's most likely one;
- KL(reference || server) over the server's top-k tokens plus one bucket for the rest of the
  vocabulary (a lower bound of the full KL: the server returns only its top k);
- the logprob error: the largest |server - reference| over the tokens the server listed.

It also compares the server's `/tokenize` of each text and chat with the checkpoint's own
tokenizer and chat template, and the prompt length the server reports with the reference's, so
a wrong template is named as such, at its first differing token. The server's tokens continue
every sequence (teacher forcing), so one early divergence does not spoil the positions after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenmill.evals.client import EvalClient, EvalRequestError, Generation
from tokenmill.evals.options import THRESHOLDS, ConformanceArgs, Thresholds, default_api_key
from tokenmill.evals.prompts import ConformancePrompt, build_prompts
from tokenmill.evals.reference import Reference

logger = logging.getLogger(__name__)

_EPS = 1e-12


@dataclass
class Sequence:
    """One prompt's generation and its comparison with the reference."""

    prompt: ConformancePrompt
    reference_ids: list[int]  # the prompt as the checkpoint's tokenizer/template makes it
    generation: Generation
    agree: np.ndarray  # [n] bool
    kl: np.ndarray  # [n]
    logprob_error: np.ndarray  # [n]
    divergence: dict[str, Any] | None


def compare_position(
    reference: torch.Tensor, sampled: int, sampled_logprob: float, top: dict[int, float]
) -> tuple[bool, float, float]:
    """(top-1 agreement, KL, logprob error) of one position: `reference` is the full
    log-softmax row, the rest is what the server returned."""
    listed = {**top, sampled: sampled_logprob}
    ids = torch.tensor(list(listed))
    server = torch.tensor(list(listed.values()), dtype=torch.float64)
    ref = reference[ids].double()
    p_ref, p_srv = ref.exp(), server.exp()
    rest_ref = (1 - p_ref.sum()).clamp(min=0)
    rest_srv = (1 - p_srv.sum()).clamp(min=0)
    kl = (p_ref * (ref - server)).sum() + rest_ref * (
        torch.log(rest_ref + _EPS) - torch.log(rest_srv + _EPS)
    )
    agree = int(reference.argmax()) == sampled
    return agree, max(float(kl), 0.0), float((ref - server).abs().max())


def _token(tokenizer: PreTrainedTokenizerBase | None, token_id: int) -> list[Any]:
    return [token_id, tokenizer.decode([token_id]) if tokenizer is not None else None]


def score_sequence(
    prompt: ConformancePrompt,
    reference_ids: list[int],
    generation: Generation,
    logprobs: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase | None,
) -> Sequence:
    """Compare a generation with the reference's `logprobs` rows, and find its first divergence."""
    rows = [
        compare_position(logprobs[t], tok, generation.logprobs[t], generation.top_logprobs[t])
        for t, tok in enumerate(generation.token_ids)
    ]
    agree = np.array([r[0] for r in rows], dtype=bool)
    divergence = None
    if not agree.all():
        t = int(np.argmin(agree))
        sampled, ref_top = generation.token_ids[t], int(logprobs[t].argmax())
        context = reference_ids[-8:] + generation.token_ids[:t]
        divergence = {
            "prompt": prompt.name,
            "group": prompt.group,
            "request_id": generation.request_id,
            "position": t,
            "context": tokenizer.decode(context[-8:]) if tokenizer is not None else None,
            "server_token": _token(tokenizer, sampled),
            "server_logprob": generation.logprobs[t],
            "reference_logprob_of_server_token": float(logprobs[t][sampled]),
            "reference_token": _token(tokenizer, ref_top),
            "reference_logprob": float(logprobs[t][ref_top]),
            "server_logprob_of_reference_token": generation.top_logprobs[t].get(ref_top),
        }
    return Sequence(
        prompt=prompt,
        reference_ids=reference_ids,
        generation=generation,
        agree=agree,
        kl=np.array([r[1] for r in rows]),
        logprob_error=np.array([r[2] for r in rows]),
        divergence=divergence,
    )


def reference_prompt_ids(
    tokenizer: PreTrainedTokenizerBase | None, p: ConformancePrompt
) -> list[int]:
    """The prompt's token ids as the checkpoint's tokenizer and chat template make them."""
    if isinstance(p.prompt, list):
        return list(p.prompt)
    assert tokenizer is not None  # text prompts are built only with a tokenizer
    if p.messages is not None:
        text = tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS
    return tokenizer.encode(p.prompt)


def tokenization_check(
    p: ConformancePrompt,
    server_ids: list[int] | None,
    reference_ids: list[int],
    tokenizer: PreTrainedTokenizerBase,
) -> dict[str, Any]:
    """The server's /tokenize against the reference's ids, with their first difference."""
    check: dict[str, Any] = {"prompt": p.name, "kind": "chat" if p.messages else "text"}
    if server_ids is None:
        return {**check, "match": None}
    check.update(match=server_ids == reference_ids, server_len=len(server_ids))
    check["reference_len"] = len(reference_ids)
    if not check["match"]:
        i = next(
            (i for i, (a, b) in enumerate(zip(server_ids, reference_ids, strict=False)) if a != b),
            min(len(server_ids), len(reference_ids)),
        )
        at = lambda ids: _token(tokenizer, ids[i]) if i < len(ids) else None  # noqa: E731
        check["first_difference"] = {
            "index": i,
            "server": at(server_ids),
            "reference": at(reference_ids),
            "server_text": tokenizer.decode(server_ids[max(0, i - 4) : i + 8]),
            "reference_text": tokenizer.decode(reference_ids[max(0, i - 4) : i + 8]),
        }
    return check


async def _query_server(
    args: ConformanceArgs, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int
) -> tuple[dict[str, Any], list[ConformancePrompt], dict[str, Generation | Exception],
           dict[str, list[int] | None]]:  # fmt: skip
    api_key = args.api_key or default_api_key()
    async with EvalClient(args.base_url, api_key, args.timeout) as client:
        card = await client.model_card(args.served_model_name)
        max_model_len = int(card.get("max_model_len") or 2048)
        prompts = build_prompts(
            tokenizer, vocab_size, max_model_len - args.max_tokens, args.prompt_lengths, args.seed
        )
        params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        limit = asyncio.Semaphore(args.concurrency)

        async def generate(p: ConformancePrompt) -> Generation:
            async with limit:
                return await client.generate(
                    p.prompt, p.messages, top_logprobs=args.top_logprobs, **params
                )

        async def tokenize(p: ConformancePrompt) -> list[int] | None:
            if isinstance(p.prompt, list):
                return None
            async with limit:
                return await client.tokenize(p.prompt if p.messages is None else None, p.messages)

        results: dict[str, Generation | Exception] = {}
        for p in prompts:  # first, alone: what the prefix-hit prompts will find cached
            if p.warm:
                results[p.name] = await generate(p)
        rest = [p for p in prompts if not p.warm]
        outcomes = await asyncio.gather(*(generate(p) for p in rest), return_exceptions=True)
        results.update({p.name: o for p, o in zip(rest, outcomes, strict=True)})  # type: ignore[misc]
        server_ids = await asyncio.gather(*(tokenize(p) for p in prompts))
    return card, prompts, results, dict(zip([p.name for p in prompts], server_ids, strict=True))


def checkpoint_config(model: str) -> dict[str, Any]:
    """The `config.json` of checkpoint `model`; `ValueError` naming model when it cannot be read
    or names no `vocab_size` (the reference is a text-only causal language model)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"model: cannot read {path}: {why}") from None
    vocab_size = config.get("vocab_size") if isinstance(config, dict) else None
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(
            f"model: {path} gives no vocab_size: conformance compares a text-only causal "
            "language model's checkpoint"
        )
    return config


def resolve_thresholds(args: ConformanceArgs, config: dict[str, Any]) -> tuple[str, Thresholds]:
    """The server's precision (auto: that of `config`, the checkpoint's config.json) and the
    thresholds in force."""
    precision = args.server_dtype
    if precision == "auto":
        precision = config.get("torch_dtype") or config.get("dtype") or "float32"
    base = THRESHOLDS.get(precision, THRESHOLDS["bfloat16"])
    return precision, Thresholds(
        min_top1=base.min_top1 if args.min_top1 is None else args.min_top1,
        max_mean_kl=base.max_mean_kl if args.max_mean_kl is None else args.max_mean_kl,
        max_logprob_error=(
            base.max_logprob_error if args.max_logprob_error is None else args.max_logprob_error
        ),
    )


def _summary(seqs: list[Sequence]) -> dict[str, Any]:
    if not seqs:
        return {"sequences": 0, "positions": 0}
    agree = np.concatenate([s.agree for s in seqs])
    kl = np.concatenate([s.kl for s in seqs])
    err = np.concatenate([s.logprob_error for s in seqs])
    return {
        "sequences": len(seqs),
        "positions": int(agree.size),
        "top1_agreement": float(agree.mean()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "max_logprob_error": float(err.max()),
        "cached_prompt_tokens": sum(s.generation.cached_tokens or 0 for s in seqs),
    }


def _per_position(seqs: list[Sequence], length: int) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {
        "top1_agreement": [],
        "mean_kl": [],
        "max_logprob_error": [],
    }
    for t in range(length):
        at = [s for s in seqs if t < s.agree.size]
        out["top1_agreement"].append(float(np.mean([s.agree[t] for s in at])) if at else None)
        out["mean_kl"].append(float(np.mean([s.kl[t] for s in at])) if at else None)
        out["max_logprob_error"].append(max((float(s.logprob_error[t]) for s in at), default=None))
    return out


def run_conformance(args: ConformanceArgs) -> dict[str, Any]:
    """Query the server, score with the reference, and return the report (`passed` inside)."""
    config = checkpoint_config(args.model)
    tokenizer_dir = args.tokenizer or args.model
    tokenizer: PreTrainedTokenizerBase | None = None
    if any(Path(tokenizer_dir).glob("tokenizer*")):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    precision, thresholds = resolve_thresholds(args, config)
    card, prompts, results, server_ids = asyncio.run(
        _query_server(args, tokenizer, config["vocab_size"])
    )
    failures: list[str] = []
    checks = []
    for p in prompts:
        if tokenizer is not None and not isinstance(p.prompt, list):
            check = tokenization_check(
                p, server_ids[p.name], reference_prompt_ids(tokenizer, p), tokenizer
            )
            checks.append(check)
            if check["match"] is False:
                d = check["first_difference"]
                failures.append(
                    f"tokenization of {p.name}: the server's /tokenize differs from the "
                    f"checkpoint's {'chat template' if p.messages else 'tokenizer'} at token "
                    f"{d['index']}: server {d['server']} vs reference {d['reference']}"
                )
    logger.info("scoring %d sequences with transformers (%s)", len(prompts), args.reference_dtype)
    reference = Reference(args.model, args.reference_dtype, args.reference_device)
    seqs: list[Sequence] = []
    for p in prompts:
        gen = results[p.name]
        if isinstance(gen, Exception):
            if not isinstance(gen, EvalRequestError):
                raise gen
            failures.append(f"request {p.name} failed: {gen}")
            continue
        ids = reference_prompt_ids(tokenizer, p)
        if gen.prompt_tokens is not None and gen.prompt_tokens != len(ids):
            failures.append(
                f"prompt length of {p.name}: the server generated from {gen.prompt_tokens} "
                f"prompt tokens, the reference's prompt has {len(ids)}"
            )
        if len(gen.token_ids) != len(gen.logprobs) or not gen.token_ids:
            failures.append(f"{p.name}: the server returned no logprobs for its tokens")
            continue
        seqs.append(score_sequence(p, ids, gen, reference.logprobs(ids, gen.token_ids), tokenizer))
    summary = _summary(seqs)
    if seqs:
        where = f"({precision} thresholds)"
        if summary["top1_agreement"] < thresholds.min_top1:
            failures.append(
                f"top-1 agreement {summary['top1_agreement']:.4f} < {thresholds.min_top1} {where}"
            )
        if summary["mean_kl"] > thresholds.max_mean_kl:
            failures.append(f"mean KL {summary['mean_kl']:.3g} > {thresholds.max_mean_kl} {where}")
        if summary["max_logprob_error"] > thresholds.max_logprob_error:
            worst = max(seqs, key=lambda s: float(s.logprob_error.max()))
            t = int(worst.logprob_error.argmax())
            failures.append(
                f"max logprob error {summary['max_logprob_error']:.3g} > "
                f"{thresholds.max_logprob_error} {where}, at {worst.prompt.name} position {t} "
                f"(token {_token(tokenizer, worst.generation.token_ids[t])})"
            )
    groups = sorted({s.prompt.group for s in seqs})
    divergences = [s.divergence for s in seqs if s.divergence is not None]
    divergences.sort(key=lambda d: d["position"])
    return {
        "passed": not failures,
        "failures": failures,
        "base_url": args.base_url,
        "served_model": card["id"],
        "model": args.model,
        "server_dtype": precision,
        "reference": {"dtype": args.reference_dtype, "device": str(reference.device)},
        "thresholds": thresholds.__dict__,
        "summary": summary,
        "groups": {g: _summary([s for s in seqs if s.prompt.group == g]) for g in groups},
        "per_position": _per_position(seqs, args.max_tokens),
        "tokenization": checks,
        "divergences": divergences[: args.max_divergences],
        "sequences": [
            {
                "prompt": s.prompt.name,
                "group": s.prompt.group,
                "request_id": s.generation.request_id,
                "prompt_token_ids": s.reference_ids,
                "output_token_ids": s.generation.token_ids,
                "cached_tokens": s.generation.cached_tokens,
                "top1_agreement": float(s.agree.mean()),
                "mean_kl": float(s.kl.mean()),
                "max_logprob_error": float(s.logprob_error.max()),
            }
            for s in seqs
        ],
    }


def format_table(report: dict[str, Any]) -> str:
    """A short text summary: one row per group, the checks, the first divergences, the verdict."""
    ref = report["reference"]
    server = f"{report['served_model']} at {report['base_url']} ({report['server_dtype']})"
    against = f"transformers ({ref['dtype']}, {ref['device']}) on {report['model']}"
    lines = [
        f"conformance of {server} against {against}",
        f"{'group':<12}{'seqs':>6}{'positions':>11}{'top-1':>8}{'mean KL':>11}"
        f"{'max KL':>11}{'max |Δlogprob|':>16}{'cached':>8}",
    ]
    for name, s in [*report["groups"].items(), ("all", report["summary"])]:
        if not s.get("positions"):
            continue
        lines.append(
            f"{name:<12}{s['sequences']:>6}{s['positions']:>11}{s['top1_agreement']:>8.3f}"
            f"{s['mean_kl']:>11.2e}{s['max_kl']:>11.2e}{s['max_logprob_error']:>16.2e}"
            f"{s['cached_prompt_tokens']:>8}"
        )
    checks = [c for c in report["tokenization"] if c["match"] is not None]
    if checks:
        good = sum(c["match"] for c in checks)
        chats = [c for c in checks if c["kind"] == "chat"]
        lines.append(
            f"tokenization: {good}/{len(checks)} prompts match the checkpoint's "
            f"(chat template: {sum(c['match'] for c in chats)}/{len(chats)})"
        )
    for d in report["divergences"]:
        lines.append(
            f"first divergence in {d['prompt']} at position {d['position']} after "
            f"{d['context']!r}: server {d['server_token']} ({d['server_logprob']:.3f}) vs "
            f"reference {d['reference_token']} ({d['reference_logprob']:.3f})"
        )
    thresholds = report["thresholds"]
    lines.append(
        f"thresholds: top-1 >= {thresholds['min_top1']}, mean KL <= {thresholds['max_mean_kl']}, "
        f"max |Δlogprob| <= {thresholds['max_logprob_error']}"
    )
    lines.append("PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"]))
    return "\n".join(lines)


def plot_agreement(report: dict[str, Any], path: str) -> None:
    """Top-1 agreement and mean KL per generated position, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = report["per_position"]
    x = list(range(len(per["top1_agreement"])))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(x, [v if v is not None else float("nan") for v in per["top1_agreement"]], "o-")
    top.axhline(report["thresholds"]["min_top1"], color="red", linestyle="--", label="threshold")
    top.set_ylabel("top-1 agreement")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="lower left")
    kl = [max(v, 1e-12) if v is not None else float("nan") for v in per["mean_kl"]]
    bottom.semilogy(x, kl, "o-", color="tab:orange")
    bottom.set_ylabel("mean KL(reference || server)")
    bottom.set_xlabel("generated position")
    fig.suptitle(
        f"{report['served_model']} ({report['server_dtype']}) vs transformers "
        f"({report['reference']['dtype']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
