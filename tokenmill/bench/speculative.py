"""Bench B4: speculative decoding against plain decoding, in the same run.

(a) Real text: the embedded demo model with prompt lookup and with its draft model, each with
adaptive speculation (the default) and with k fixed, on copy-heavy prompts (code to edit, a
document to quote) and on free generation: acceptance length and speedup over plain greedy
decoding.
(b) Verification efficiency at real shapes (dummy weights): an oracle proposer replays the
target's own greedy tokens (recorded by a plain run), each draft right with probability `a`, so
a verify step yields `(1 - a^(k+1)) / (1 - a)` tokens on average; measured tokens/s over plain
decoding's, against that ideal, with k fixed. At the batch sizes of `adaptive_batch_sizes` the
same oracle runs with adaptive speculation too (what a user gets: it must never be slower than
plain decoding).

The oracle's verdicts are teacher-forced. With random weights in bfloat16 many next-token
logits nearly tie, and a verify pass (1 + k query tokens per row, the prefill attention kernel,
GEMMs) rounds differently from a decode step (GEMVs, the decode kernel): the target's own
argmax then departs from the recorded continuation at some near-tie, and from there on no
replayed draft matches, which measures the weights' ties, not verification. So the verify step
runs in full (drafts in the batch, the forward over every position, the greedy verification on
the device, the tokens copied back), and only then, on the host, each verify row's result is
replaced by the oracle's: its first `n` drafts accepted, `n` being where the oracle's first
wrong draft was, then the recorded token after them (every other sampled row takes its
recorded token too). The device work and the host work per step are those of a real verify
at acceptance rate `a`; the tokens are the plain run's by construction (`same_tokens_as_plain`
checks the bookkeeping, not numerics).
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
import json
import logging
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from tokenmill.batch import Logprob, Request, SchedulerOutput
from tokenmill.bench.options import OfflineBenchArgs
from tokenmill.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR, ModelConfig
from tokenmill.engine.scheduler import Scheduler
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.proposer import Drafts, HostProposer
from tokenmill.spec.rejection import PLACEHOLDER

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class SpecBenchArgs:
    """B4's settings; `config` is the dummy-weight checkpoint of part (b) (None: skip it)."""

    config: str | None = None
    dtype: str = "bfloat16"
    device: str | None = None
    num_speculative_tokens: int = 4
    acceptance_rates: Sequence[float] = (1.0, 0.8, 0.6)
    batch_sizes: Sequence[int] = (1, 64)
    adaptive_batch_sizes: Sequence[int] = (64,)
    input_len: int = 512
    output_len: int = 256
    demo_output_len: int = 128
    seed: int = 0
    repeats: int = 1
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(args: OfflineBenchArgs) -> SpecBenchArgs:
        """B4's settings from `tokenmill bench offline --workload b4`'s options."""
        return SpecBenchArgs(
            config=args.config, dtype=args.dtype, device=args.device,
            num_speculative_tokens=args.num_speculative_tokens,
            acceptance_rates=args.acceptance_rate_list(), batch_sizes=args.batch_size_list(),
            adaptive_batch_sizes=args.adaptive_batch_size_list(),
            input_len=args.input_len, output_len=args.output_len, seed=args.seed,
            repeats=args.repeats, engine_kwargs=args.engine_kwargs,
        )  # fmt: skip


def ideal_tokens_per_step(rate: float, k: int) -> float:
    """Expected tokens one verify emits when each draft is right with probability `rate`."""
    return float(k + 1) if rate >= 1 else (1 - rate ** (k + 1)) / (1 - rate)


class OracleProposer(HostProposer):
    """Drafts the target's known greedy continuation of each prompt, each draft right with
    probability `rate` (the first wrong one ends acceptance); always `k` drafts, so a verify
    costs what a real proposer's would. `teacher_force` makes the verdicts its own (see the
    module docstring). The oracle's own host work is benchmark overhead, charged to the
    speculative steps it measures: it is vectorised over the batch (at batch 64 a per-row loop
    cost about as much as the scheduler's own work)."""

    def __init__(
        self,
        k: int,
        continuations: dict[tuple[int, ...], list[int]],
        rate: float,
        vocab_size: int,
        seed: int,
    ) -> None:
        self.k = k
        self.vocab_size = vocab_size
        self.prompt_len = len(next(iter(continuations)))
        # One row per prompt, keyed by the prompt's bytes (a row's key costs a copy, not a
        # tuple of its ints), its continuation padded with k zeros.
        width = max(len(c) for c in continuations.values()) + k
        self.truth = np.zeros((len(continuations), width), dtype=np.int64)
        self.row_of: dict[bytes, int] = {}
        for row, (prompt, continuation) in enumerate(continuations.items()):
            self.truth[row, : len(continuation)] = continuation
            self.row_of[_key(np.array(prompt))] = row
        self.rate = rate
        self.rng = np.random.default_rng(seed)
        # per prompt row: drafts right in its latest proposal (before its first wrong one)
        self.num_right = np.zeros(len(continuations), dtype=np.int64)
        self._rows: dict[Request, int] = {}  # each request's prompt row, looked up once
        # The continuations as lists, which the verdicts slice row by row (`_verdicts`).
        self._continuations = [list(c) for c in continuations.values()]

    def propose(self, token_ids: Sequence[np.ndarray], max_drafts: np.ndarray) -> Drafts:
        rows = np.array([self.row_of[_key(t[: self.prompt_len])] for t in token_ids])
        done = np.array([len(t) for t in token_ids]) - self.prompt_len
        # Past a continuation's end (zeros from there on), the last column is a padding zero.
        at = np.minimum(done[:, None] + np.arange(self.k), self.truth.shape[1] - 1)
        truth = self.truth[rows[:, None], at]
        right = self.rng.random((len(rows), self.k)) < self.rate
        self.num_right[rows] = np.where(right.all(axis=1), self.k, np.argmin(right, axis=1))
        drafts = np.where(right, truth, (truth + 1) % self.vocab_size)
        return Drafts(token_ids=drafts, num_drafts=np.minimum(max_drafts, self.k).astype(np.int64))

    def teacher_force(self, scheduler: Scheduler) -> None:
        """Make `scheduler` apply the oracle's verdicts instead of the verifier's: each step's
        tokens are replaced, for every row at once, before the scheduler applies them."""
        update = scheduler.update

        def forced(
            out: SchedulerOutput, token_ids: list[int], logprobs: list[dict[int, Logprob] | None]
        ) -> list[tuple[Request, int]]:
            sampled = [s for s in out.seqs if s.num_samples]
            if sampled:
                token_ids = self._verdicts([s.request for s in sampled],
                                           np.array([s.num_samples for s in sampled]))  # fmt: skip
            return update(out, token_ids, logprobs)

        scheduler.update = forced  # type: ignore[method-assign]

    def _verdicts(self, requests: list[Request], num_samples: np.ndarray) -> list[int]:
        """The tokens rows of `num_samples` sampled positions each emit under the oracle, row
        after row: the first `min(right drafts, n - 1) + 1` of its continuation from where the
        request is (fewer at the continuation's end), then placeholders up to n. This runs
        between reading a verify step and launching the next, where every numpy call is a
        few microseconds of the device idling: a plain Python pass, a slice of the row's
        continuation each (numpy's dozen calls cost the development CPU ~0.05 ms a verify step at
        batch 1; at batch 64, hot, 39 us against numpy's 31)."""
        out: list[int] = []
        for req, n in zip(requests, num_samples.tolist(), strict=True):
            row = self._row(req)
            done, right = len(req.output_token_ids), int(self.num_right[row])
            emitted = self._continuations[row][done : done + min(right, n - 1) + 1]
            out += emitted
            out += [PLACEHOLDER] * (n - len(emitted))
        return out

    def _row(self, req: Request) -> int:
        """The row of `req`'s prompt in the continuations table (looked up once)."""
        row = self._rows.get(req)
        if row is None:
            row = self._rows[req] = self.row_of[_key(req.token_array()[: self.prompt_len])]
        return row


def _key(prompt: np.ndarray) -> bytes:
    return prompt.astype(np.int64, copy=False).tobytes()


def run_b4(args: SpecBenchArgs) -> dict[str, Any]:
    """Both parts of B4; returns the report."""
    report: dict[str, Any] = {"workload": "b4", "k": args.num_speculative_tokens}
    report["demo"] = _demo_part(args)
    if args.config is not None:
        report["oracle"] = _oracle_part(args)
    return report


def _demo_prompts() -> dict[str, str]:
    """Copy-heavy prompts (code to edit, a document to quote) and a free one."""
    code = inspect.getsource(textwrap.dedent)
    doc = (json.__doc__ or "").strip().split("\n\n")[0]
    return {
        "code_edit": f"{code}\n\n# The same function, with a comment on each step:\n\n"
        + code.split("\n")[0],
        "quote": f"{doc}\n\nQuoting the first sentence above exactly: {doc[:40]}",
        "free": "The tutorial explains how to define a function in Python.",
    }


def _demo_part(args: SpecBenchArgs) -> dict[str, Any]:
    k = args.num_speculative_tokens
    proposers: dict[str, dict[str, Any]] = {
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
        "draft_model": {"method": "draft_model", "model": str(DEMO_DRAFT_DIR),
                        "num_speculative_tokens": k},
    }  # fmt: skip
    # Each proposer with adaptive speculation (the default) and with k fixed.
    methods: dict[str, dict[str, Any] | None] = {"plain": None}
    for name, spec in proposers.items():
        methods[name] = {**spec, "adaptive": True}
        methods[f"{name} fixed k"] = {**spec, "adaptive": False}
    prompts = _demo_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=args.demo_output_len, ignore_eos=True)
    results: dict[str, Any] = {}
    plain_tokens: dict[str, list[int]] = {}
    for name, spec in methods.items():
        build = functools.partial(
            LLM, str(DEMO_MODEL_DIR), device=args.device, seed=args.seed,
            enable_prefix_caching=False, speculative_config=spec, **args.engine_kwargs,
        )  # fmt: skip
        use = functools.partial(_demo_rows, prompts=prompts, params=greedy, plain=plain_tokens)
        results[name] = _with_engine(build, use)
    for name in methods:
        for label, row in results[name].items():
            row["speedup"] = row["output_tok_s"] / results["plain"][label]["output_tok_s"]
    return results


def _demo_rows(
    llm: LLM, prompts: dict[str, str], params: SamplingParams, plain: dict[str, list[int]]
) -> dict[str, dict[str, Any]]:
    """Each prompt's tokens/s, acceptance length and whether its tokens are `plain`'s (the
    first engine run, plain decoding, fills `plain`)."""
    llm.generate(["Warm up."], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    rows = {}
    for label, text in prompts.items():
        before = _spec_counts(llm)
        start = time.perf_counter()
        out = llm.generate([text], params, use_tqdm=False)[0].outputs[0].token_ids
        elapsed = time.perf_counter() - start
        drafts, accepted = np.subtract(_spec_counts(llm), before)
        plain.setdefault(label, out)
        rows[label] = {
            "output_tok_s": len(out) / elapsed,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "same_tokens_as_plain": out == plain[label],
        }
    return rows


def _spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.scheduler.spec_stats
    return stats.num_drafts, stats.num_accepted_tokens


def _oracle_part(args: SpecBenchArgs) -> dict[str, Any]:
    assert args.config is not None
    rng = np.random.default_rng(args.seed)
    vocab = ModelConfig.from_pretrained(args.config).vocab_size
    results: dict[str, Any] = {}
    for batch in args.batch_sizes:
        prompts = [(rng.integers(10, 1000, args.input_len) % vocab).tolist() for _ in range(batch)]
        results[f"batch_{batch}"] = _oracle_batch(args, prompts, vocab)
    return results


def _oracle_batch(args: SpecBenchArgs, prompts: list[list[int]], vocab: int) -> dict[str, Any]:
    """Plain decoding of `prompts`, then the oracle at each acceptance rate (and adaptive)."""
    plain_rate, outputs = _with_engine(
        functools.partial(_engine, args, None),
        functools.partial(_decode_rate, prompts=prompts, output_len=args.output_len,
                          repeats=args.repeats),
    )  # fmt: skip
    continuations = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
    rows: dict[str, Any] = {"plain_decode_tok_s": plain_rate}
    # Fixed k measures verification against its ideal; adaptive, what a user gets.
    modes = [False, True] if len(prompts) in args.adaptive_batch_sizes else [False]
    for rate, adaptive in itertools.product(args.acceptance_rates, modes):
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "adaptive": adaptive}  # fmt: skip
        oracle = OracleProposer(args.num_speculative_tokens, continuations, rate, vocab, args.seed)
        spec_rate, spec_outputs, stats, costs = _with_engine(
            functools.partial(_engine, args, spec),
            functools.partial(_oracle_rate, oracle=oracle, prompts=prompts,
                              output_len=args.output_len, repeats=args.repeats),
        )  # fmt: skip
        ideal = ideal_tokens_per_step(rate, args.num_speculative_tokens)
        speedup = spec_rate / plain_rate
        chosen = stats.chosen_drafts
        rows[f"a={rate}" + (" adaptive" if adaptive else "")] = {
            "decode_tok_s": spec_rate,
            "speedup": speedup,
            "tokens_per_verify": stats.mean_acceptance_length,
            "ideal_tokens_per_verify": ideal,
            "pct_of_ideal_speedup": 100 * speedup / ideal,
            "mean_drafts_chosen": chosen.total / max(chosen.count, 1),
            "same_tokens_as_plain": spec_outputs == outputs,
        }
        if adaptive:  # what the policy learnt: step size (query tokens) -> [ms, steps measured]
            rows[f"a={rate} adaptive"]["step_costs_ms"] = {
                kind: {size: [1e3 * seconds, count] for size, (seconds, count) in table.items()}
                for kind, table in costs.items()
            }
    return rows


def _oracle_rate(
    llm: LLM, oracle: OracleProposer, prompts: list[list[int]], output_len: int, repeats: int
) -> tuple[float, list, Any, dict[str, dict[int, tuple[float, int]]]]:
    """Decode rate and outputs with `oracle` proposing, the engine's speculation stats and the
    step costs adaptive speculation measured."""
    scheduler = llm.engine.scheduler
    scheduler.host_proposer = oracle
    oracle.teacher_force(scheduler)
    rate, outputs = _decode_rate(llm, prompts, output_len, repeats)
    kinds = (("plain", False), ("verify", True))
    costs = {kind: scheduler.step_cost.table(verify) for kind, verify in kinds}
    return rate, outputs, scheduler.spec_stats, costs


def _engine(args: SpecBenchArgs, spec: dict[str, Any] | None) -> LLM:
    assert args.config is not None
    return LLM(args.config, load_format="dummy", dtype=args.dtype, device=args.device,
               seed=args.seed, enable_prefix_caching=False, speculative_config=spec,
               **args.engine_kwargs)  # fmt: skip


def _with_engine(build: Callable[[], LLM], use: Callable[[LLM], T]) -> T:
    """`use(engine)` on a fresh engine from `build` that is freed before this returns: a
    benchmark's engines each hold most of the GPU's memory (weights and a KV pool sized by
    `kv_cache_memory_bytes`), so two may not be alive at once."""
    llm = build()
    device = llm.engine.runner.device
    try:
        return use(llm)
    finally:
        llm.close()
        del llm  # the last reference: collected below
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _decode_rate(
    llm: LLM, prompts: list[list[int]], output_len: int, repeats: int = 1
) -> tuple[float, list]:
    """Decode tokens/s of greedy generation (prefill time taken out), the median of `repeats`
    timed generations, and the outputs.

    The prefill of the whole batch is timed alone (one token each) and taken out of the full
    run's time; both are warmed up first with the same batch, so neither pays a first use of
    a shape (graph capture, kernel tuning) that the other does not."""
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, first, use_tqdm=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        outputs = llm.generate(prompts, full, use_tqdm=False)
        total = time.perf_counter() - start
        if total <= prefill:
            raise RuntimeError(
                f"decode took no time: prefill alone {prefill:.3f} s, all {total:.3f} s"
            )
        rates.append(len(prompts) * (output_len - 1) / (total - prefill))
    return float(np.median(rates)), [o.outputs[0].token_ids for o in outputs]


def summary_rows(report: dict[str, Any]) -> list[str]:
    """A short human-readable table of a B4 report."""
    rows = []
    for method, results in report["demo"].items():
        if method == "plain":
            continue
        for label, r in results.items():
            length = r["acceptance_length"]
            rows.append(
                f"B4 demo {method:19s} {label:9s}: {r['output_tok_s']:7.1f} tok/s, "
                f"x{r['speedup']:.2f} over plain, acceptance length "
                f"{'-' if length is None else f'{length:.2f}'}, same tokens: "
                f"{r['same_tokens_as_plain']}"
            )
    for batch, results in report.get("oracle", {}).items():
        plain = results["plain_decode_tok_s"]
        for label, r in results.items():
            if label == "plain_decode_tok_s":
                continue
            rows.append(
                f"B4 oracle {batch} {label}: {r['decode_tok_s']:.0f} tok/s vs plain {plain:.0f} "
                f"(x{r['speedup']:.2f}; ideal x{r['ideal_tokens_per_verify']:.2f}: "
                f"{r['pct_of_ideal_speedup']:.0f}%), {r['tokens_per_verify']:.2f} tokens/verify, "
                f"{r['mean_drafts_chosen']:.2f} drafts/request-step, "
                f"same tokens: {r['same_tokens_as_plain']}"
            )
            for kind, table in r.get("step_costs_ms", {}).items():
                costs = ", ".join(f"{size}: {ms:.2f} ms x{n}" for size, (ms, n) in table.items())
                rows.append(f"  {kind} step costs learnt (query tokens: ms x steps): {costs}")
    return rows
