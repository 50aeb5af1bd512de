"""Adaptive speculation's choices on the CPU, with step costs measured elsewhere (a GPU).

Runs the real engine and scheduler (a micro model with dummy weights, CPU) on B4's oracle
proposer at acceptance `--rate` and batch `--batch`, with the policy's step costs fixed to the
tables given (`--plain-ms` and `--verify-ms`: query tokens -> ms, as B4's adaptive rows print
what the policy learnt on the GPU). Prints the steps in order (V: verify, .: plain), how many
of each, and the time those steps would take at the given costs against plain decoding's
steps, so a policy change can be judged before the GPU measures it. It replays decisions, not
speed: a verify's tokens come from the oracle, whatever the micro model computes.

python benchmarks/adaptive_replay.py --rate 0.6 --batch 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill import LLM, SamplingParams
from tokenmill.bench.speculative import OracleProposer
from tokenmill.spec.adaptive import StepCost

# A model small enough that a CPU step takes milliseconds: the replay is about decisions.
MICRO_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
    "tie_word_embeddings": False, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip
# Qwen3-0.6B on an H200 at batch 64 (docs/perf-notes.md, session 15).
PLAIN_MS = "1:0.86,16:1.6,45:2.42,64:2.78"
VERIFY_MS = "5:1.98,64:3.7,128:5.35,181:5.27,256:6.29,320:6.43"


class FixedCost(StepCost):
    """Step costs that stay as given: the engine's measurements are ignored."""

    def __init__(self, plain: dict[int, float], verify: dict[int, float]) -> None:
        super().__init__()
        for table, is_verify in ((plain, False), (verify, True)):
            for size, seconds in table.items():
                super().observe(size, seconds, is_verify)

    def observe(self, num_tokens: int, seconds: float, verify: bool) -> None:
        pass


class SimulatedCost(StepCost):
    """Step costs learnt as on the GPU, from nothing: each step the engine measures is
    observed at what `truth` prices it, times log-normal noise of `noise` (the spread of a
    step's time between steps), instead of its CPU time; a share `outliers` of the steps
    takes `OUTLIER` times as long (a garbage collection, another process holding the host)."""

    OUTLIER = 20.0

    def __init__(
        self, truth: StepCost, noise: float, outliers: float, rng: np.random.Generator
    ) -> None:
        super().__init__()
        self.truth, self.noise, self.outliers, self.rng = truth, noise, outliers, rng

    def observe(self, num_tokens: int, seconds: float, verify: bool) -> None:
        true = float(self.truth.predict(np.array(num_tokens), verify))
        factor = float(self.rng.lognormal(0.0, self.noise))
        if self.rng.random() < self.outliers:
            factor *= self.OUTLIER
        super().observe(num_tokens, true * factor, verify)


def _table(text: str) -> dict[int, float]:
    """ "tokens:ms,..." as {tokens: seconds}."""
    pairs = (item.split(":") for item in text.split(",") if item)
    return {int(n): float(ms) / 1e3 for n, ms in pairs}


def replay(rate: float, batch: int, output_len: int, plain_ms: str, verify_ms: str,
           k: int = 4, seed: int = 0, learn: bool = False, noise: float = 0.1,
           outliers: float = 0.0, repeats: int = 1,
           input_len: int = 64) -> dict[str, Any]:  # fmt: skip
    """The steps adaptive speculation takes (see the module docstring). `learn`: the policy
    starts knowing no cost and learns them (`SimulatedCost`); `repeats`: generations of the
    batch on the same engine, each after a one-token generation, as B4 times them."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as model:
        (Path(model) / "config.json").write_text(json.dumps(MICRO_CONFIG))
        kwargs = {"device": "cpu", "load_format": "dummy", "max_num_seqs": batch, "seed": seed}
        plain = LLM(model, **kwargs)
        vocab = plain.config.model.vocab_size
        prompts = [rng.integers(10, vocab, input_len).tolist() for _ in range(batch)]
        greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        outputs = plain.generate(prompts, greedy, use_tqdm=False)
        continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs,
                                                                          strict=True)}  # fmt: skip
        spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": True}
        llm = LLM(model, speculative_config=spec, **kwargs)
    scheduler = llm.engine.scheduler
    cost = FixedCost(_table(plain_ms), _table(verify_ms))
    scheduler.step_cost = SimulatedCost(cost, noise, outliers, rng) if learn else cost
    scheduler.padded_verify_rows = batch  # as with CUDA graphs on the GPU
    oracle = OracleProposer(k, continuations, rate, vocab, seed)
    scheduler.host_proposer = oracle
    oracle.teacher_force(scheduler)
    steps: list[tuple[bool, int]] = []  # (verify, query tokens as a graph computes them)
    launch = llm.engine.runner.launch

    def recorded(plan, *args, **kwargs):  # type: ignore[no-untyped-def]
        q = int(plan.query_lens.max())
        if plan.samples_every_token:  # decode or verify, no prefill
            steps.append((q > 1, plan.num_rows * q))
        return launch(plan, *args, **kwargs)

    llm.engine.runner.launch = recorded  # type: ignore[method-assign]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(repeats):
        llm.generate(prompts, first, use_tqdm=False)
        llm.generate(prompts, greedy, use_tqdm=False)
    seconds = sum(float(cost.predict(np.array(n), verify)) for verify, n in steps)
    plain_seconds = repeats * (output_len - 1) * float(cost.predict(np.array(batch), False))
    return {
        "sequence": "".join("V" if verify else "." for verify, _ in steps),
        "verify_steps": sum(verify for verify, _ in steps),
        "plain_steps": sum(not verify for verify, _ in steps),
        "ms_at_given_costs": 1e3 * seconds,
        "plain_decoding_ms": 1e3 * plain_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=0.6, help="the oracle's acceptance rate")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens (B4: 512)")
    parser.add_argument("--output-len", type=int, default=256, help="tokens per request")
    parser.add_argument("--plain-ms", default=PLAIN_MS, help="plain steps: tokens:ms,...")
    parser.add_argument("--verify-ms", default=VERIFY_MS, help="verify steps: tokens:ms,...")
    parser.add_argument(
        "--learn",
        action="store_true",
        help="start from no costs and learn "
        "the given ones, measured with noise, as the engine does on a GPU",
    )
    parser.add_argument(
        "--noise",
        type=float,
        default=0.1,
        help="--learn: the log-normal spread of a measured step's time",
    )
    parser.add_argument(
        "--outliers",
        type=float,
        default=0.0,
        help=f"--learn: the share of steps measured {SimulatedCost.OUTLIER:.0f}x as long",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts, oracle and noise")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="generations of the batch on one engine (B4 runs 3, after a warm-up)",
    )
    args = parser.parse_args()
    report = replay(args.rate, args.batch, args.output_len, args.plain_ms, args.verify_ms,
                    learn=args.learn, noise=args.noise, outliers=args.outliers,
                    repeats=args.repeats, seed=args.seed,
                    input_len=args.input_len)  # fmt: skip
    print(report["sequence"])
    print(f"rate {args.rate} batch {args.batch}: {report['verify_steps']} verify and "
          f"{report['plain_steps']} plain steps, {report['ms_at_given_costs']:.0f} ms at the "
          f"given costs vs plain decoding {report['plain_decoding_ms']:.0f} ms "
          f"(x{report['plain_decoding_ms'] / report['ms_at_given_costs']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
