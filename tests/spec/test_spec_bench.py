"""B4's oracle proposer and its ideal: the engine emits the target's tokens whatever the rate,
and a verify yields the expected number of tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.bench.speculative import OracleProposer, ideal_tokens_per_step


def test_ideal_tokens_per_verify() -> None:
    assert ideal_tokens_per_step(1.0, 4) == 5
    assert ideal_tokens_per_step(0.0, 4) == 1
    assert ideal_tokens_per_step(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)


@pytest.mark.parametrize("rate", [1.0, 0.6])
def test_oracle_drafts_reach_the_ideal_and_keep_the_tokens(llama_dir: Path, rate: float) -> None:
    prompt = list(range(30, 50))
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = LLM(str(llama_dir), device="cpu").generate([prompt], greedy, use_tqdm=False)
    expected = plain[0].outputs[0].token_ids
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    llm = LLM(str(llama_dir), device="cpu", speculative_config=spec)
    vocab = llm.config.model.vocab_size
    llm.engine.scheduler.host_proposer = OracleProposer(4, {tuple(prompt): expected}, rate,
                                                         vocab, seed=0)  # fmt: skip
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
    stats = llm.engine.scheduler.spec_stats
    if rate == 1.0:  # every verify but the last (capped by max_tokens) emits k + 1 tokens
        assert stats.num_drafts == 12 and stats.mean_acceptance_length == pytest.approx(59 / 12)
    else:
        assert 1.3 < stats.mean_acceptance_length < 3.0


def test_teacher_forced_oracle_applies_its_own_verdicts(llama_dir: Path) -> None:
    """Teacher-forced, the oracle's verdicts stand even where the target's argmax would differ
    (numerics of a verify pass): a continuation the model would never produce is emitted as
    recorded, at the acceptance length the rate sets."""
    prompt = list(range(30, 50))
    recorded = [(7 * i + 3) % 200 + 10 for i in range(60)]  # not the model's continuation
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    llm = LLM(str(llama_dir), device="cpu", speculative_config=spec)
    oracle = OracleProposer(4, {tuple(prompt): recorded}, 1.0, llm.config.model.vocab_size, 0)
    llm.engine.scheduler.host_proposer = oracle
    oracle.teacher_force(llm.engine.scheduler)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == recorded
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts == 12 and stats.mean_acceptance_length == pytest.approx(59 / 12)


def test_host_time_benchmark_splits_a_verify_step_into_phases(llama_dir: Path) -> None:
    """benchmarks/spec_host_time.py: a verify step's phases are timed, it emits more than one
    token, and its greedy verification dispatches no torch operator of its own; a verify step
    leaves the device idle while the host prepares the next (read first), a plain decode step
    does not (overlapped)."""
    from benchmarks.spec_host_time import measure

    verify = measure(str(llama_dir), batch=1, input_len=16, steps=24, k=3, rate=0.8)
    assert verify["tokens_per_step"] > 1.5
    assert {"propose", "verify", "read", "update", "schedule"} <= set(verify["phase_ms_per_step"])
    assert verify["host_ms_per_step"] > 0
    assert verify["torch_ops_per_step"].get("verify", 0) == 0
    assert verify["idle_host_ms_per_step"] > 0
    plain = measure(str(llama_dir), batch=1, input_len=16, steps=24, k=3, rate=None)
    assert plain["idle_host_ms_per_step"] == 0


def test_oracle_rows_report_the_median_of_repeats_and_the_costs_adaptive_learnt(
    llama_dir: Path,
) -> None:
    from tokenmill.bench.speculative import SpecBenchArgs, _oracle_part, summary_rows

    args = SpecBenchArgs(config=str(llama_dir), dtype="float32", device="cpu",
                         acceptance_rates=[0.8], batch_sizes=[2], adaptive_batch_sizes=[2],
                         input_len=16, output_len=20, repeats=2)  # fmt: skip
    rows = _oracle_part(args)["batch_2"]
    assert rows["plain_decode_tok_s"] > 0
    assert rows["a=0.8"]["same_tokens_as_plain"] and rows["a=0.8 adaptive"]["same_tokens_as_plain"]
    assert "step_costs_ms" not in rows["a=0.8"]
    costs = rows["a=0.8 adaptive"]["step_costs_ms"]
    assert set(costs) == {"plain", "verify"} and costs["verify"]  # it verified, and measured
    assert all(ms > 0 and n >= 1 for table in costs.values() for ms, n in table.values())
    lines = summary_rows({"demo": {}, "oracle": {"batch_2": rows}})
    assert any("verify step costs learnt" in line for line in lines)


def test_repeats_must_be_positive() -> None:
    from tokenmill.bench.options import OfflineBenchArgs

    with pytest.raises(ValueError, match="repeats"):
        OfflineBenchArgs(config="unused", workload="b4", repeats=0)


class _Row:
    """What the oracle reads of a request: its tokens and its output so far."""

    def __init__(self, prompt: object, output: list[int]) -> None:
        self.prompt, self.output_token_ids = prompt, output

    def token_array(self) -> object:
        return self.prompt


def test_oracle_verdicts_follow_the_continuation_for_every_row_at_once() -> None:
    """Each row emits its continuation from where it is, one token more than the drafts its
    latest proposal had right (at most its sampled positions), cut at the continuation's
    end, then placeholders: the per-row rule, checked row by row on random states."""
    import numpy as np

    from tokenmill.bench.speculative import PLACEHOLDER

    rng = np.random.default_rng(3)
    prompts = [tuple(rng.integers(10, 90, 6).tolist()) for _ in range(8)]
    continuations = {p: rng.integers(10, 90, int(rng.integers(3, 12))).tolist() for p in prompts}
    oracle = OracleProposer(4, continuations, 0.5, 100, seed=0)
    for _ in range(50):
        requests, expected = [], []
        num_samples = rng.integers(1, 6, len(prompts))
        for prompt, n in zip(prompts, num_samples.tolist(), strict=True):
            cont = continuations[prompt]
            done = int(rng.integers(0, len(cont) + 1))
            requests.append(_Row(np.array(prompt), cont[:done]))
            row = oracle.row_of[np.array(prompt, dtype=np.int64).tobytes()]
            oracle.num_right[row] = right = int(rng.integers(0, 5))
            emitted = cont[done : done + min(right, n - 1) + 1]
            expected += emitted + [PLACEHOLDER] * (n - len(emitted))
        assert oracle._verdicts(requests, num_samples) == expected


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_oracle_proposals_count_their_right_drafts(rate: float) -> None:
    """A proposal's drafts are the continuation from where each row is, each right with
    probability `rate` (a wrong one is the right token + 1); the count kept for the verdicts
    is the number before the first wrong one."""
    import numpy as np

    rng = np.random.default_rng(5)
    prompts = [tuple(rng.integers(10, 90, 6).tolist()) for _ in range(16)]
    continuations = {p: rng.integers(10, 90, 30).tolist() for p in prompts}
    oracle = OracleProposer(4, continuations, rate, 100, seed=1)
    done = rng.integers(0, 20, len(prompts))
    rows = [np.array(p + tuple(continuations[p][:d])) for p, d in zip(prompts, done, strict=True)]
    drafts = oracle.propose(rows, np.array([4, 2] * 8))
    assert drafts.num_drafts.tolist() == [4, 2] * 8 and drafts.num_drafts.dtype == np.int64
    for i, (prompt, d) in enumerate(zip(prompts, done.tolist(), strict=True)):
        truth = np.array(continuations[prompt][d : d + 4])
        right = drafts.token_ids[i] == truth
        assert np.all(right | (drafts.token_ids[i] == (truth + 1) % 100))
        wrong = np.flatnonzero(~right)
        row = oracle.row_of[np.array(prompt, dtype=np.int64).tobytes()]
        assert oracle.num_right[row] == (wrong[0] if len(wrong) else 4)
    if rate in (0.0, 1.0):
        assert oracle.num_right.tolist() == [int(rate) * 4] * 16


def test_adaptive_replay_reports_the_policys_steps_at_given_costs() -> None:
    """benchmarks/adaptive_replay.py: with drafts that are always right and verifies as cheap
    as decodes, the policy verifies; the time it reports follows the given costs."""
    from benchmarks.adaptive_replay import replay

    report = replay(1.0, 2, 16, plain_ms="1:1,2:1", verify_ms="4:1,10:1")
    assert report["verify_steps"] >= 2
    assert len(report["sequence"]) == report["verify_steps"] + report["plain_steps"]
    assert report["ms_at_given_costs"] < report["plain_decoding_ms"] == pytest.approx(15.0)
