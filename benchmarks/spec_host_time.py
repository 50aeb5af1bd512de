"""Where the host time of a speculative (verify) step goes, against a plain decode step.

Runs the demo model (or `--config` with dummy weights) greedily at batch `--batch`, plain and
with B4's teacher-forced oracle proposer (`--rate`, k = `--k`, adaptive off unless
`--adaptive`), and times every phase of an engine step by wrapping the methods that run it
(exclusive times: a phase nested in another is not counted twice). On the CPU the times are CPU
seconds of the engine's thread, torch on one thread, so that other processes on a shared
machine do not count; with `--device cuda`, wall seconds, and `read` includes waiting for the
GPU. The model's forward pass (a graph replay on the GPU) is its own phase, so on the CPU,
where it runs inside the launch, the other phases are the host time a GPU step would carry.
`device_ms_per_step` is the launched steps' own time (CUDA events from launch to sampled
tokens; on the CPU, the forward and sampling, wall time). `idle_host_ms_per_step` is the host
time while the device has nothing queued (`IdleGaps`, from a generation of its own). `torch
ops` counts the ATen operators the phases dispatch per step (on the GPU each is at least one
kernel launch); the forward pass is left out of the count (CUDA graphs replay it). `--kernels
N` (GPU) adds the N kernels with the most device time per step, plain and verify, from a
generation of its own under the CUDA profiler.

python benchmarks/spec_host_time.py [--batch 1] [--steps 200] [--config DIR --device cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import tokenmill.runner.model_runner as model_runner
from tokenmill import LLM, SamplingParams
from tokenmill.batch import StepPlan
from tokenmill.bench.speculative import OracleProposer
from tokenmill.config import DEMO_MODEL_DIR
from tokenmill.runner.model_runner import LaunchedStep
from tokenmill.runner.sampler import Sampler, SamplingBatch
from tokenmill.runner.spec_decode import SpecDecoder


class _OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class PhaseTimer:
    """Exclusive seconds (or, counting, ATen operators) per phase, from wrapped callables.

    Counting runs every operator through Python, so a timer counts or times, not both. On the
    CPU it times CPU seconds of this thread (torch on one thread): on a shared machine, what a
    phase costs, not how long other processes kept it waiting. On the GPU, wall seconds (a
    wait for the GPU spins, which would count as CPU time too)."""

    def __init__(self, cuda: bool = False, count_ops: bool = False) -> None:
        self.clock = time.perf_counter if cuda else time.thread_time
        self.seconds: dict[str, float] = defaultdict(float)
        self.ops: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [phase, start, child seconds, child ops]
        self._counter = _OpCounter() if count_ops else None
        self._restore: list[Callable[[], None]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        counter = self._counter
        ops = counter.count if counter is not None else 0
        outermost = not self._stack
        self._stack.append([name, self.clock(), 0.0, 0])
        try:
            if counter is not None and outermost:
                with counter:
                    yield
            else:
                yield
        finally:
            _, start, child_seconds, child_ops = self._stack.pop()
            elapsed = self.clock() - start
            ops = counter.count - ops if counter is not None else 0
            self.seconds[name] += elapsed - child_seconds
            self.ops[name] += ops - child_ops
            if self._stack:
                self._stack[-1][2] += elapsed
                self._stack[-1][3] += ops

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time `owner.attr` (a class's or an instance's callable) as phase `name`."""
        original = owner.__dict__[attr] if attr in owner.__dict__ else getattr(owner, attr)
        is_static = isinstance(original, staticmethod)
        function = original.__func__ if is_static else original
        timer = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            with timer.phase(name):
                return function(*args, **kwargs)

        setattr(owner, attr, staticmethod(timed) if is_static else timed)
        self._restore.append(lambda: setattr(owner, attr, original))

    def restore(self) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.ops.clear()


class IdleGaps:
    """Host seconds during which the device has nothing queued: from the read of the newest
    launched step to the next step's device start (`LaunchedStep.start`). A step read after the
    next one is launched (overlap scheduling) leaves no such gap; a verify step, read before
    the next is scheduled, does: applying its tokens, proposing, planning, laying out and
    packing the next step all happen in it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds = 0.0
        self._newest: LaunchedStep | None = None
        self._since: float | None = None
        self._undo: list[tuple[str, Any]] = []

    def install(self) -> None:
        read, start = LaunchedStep.read, LaunchedStep.start
        gaps = self

        def timed_read(step: LaunchedStep) -> Any:
            out = read(step)
            if step is gaps._newest:
                gaps._since = gaps.clock()
            return out

        def timed_start(step: LaunchedStep) -> None:
            if not step._started:  # its first start: the device's work begins here
                if gaps._since is not None:
                    gaps.seconds += gaps.clock() - gaps._since
                gaps._since, gaps._newest = None, step
            start(step)

        self._undo = [("read", read), ("start", start)]
        LaunchedStep.read, LaunchedStep.start = timed_read, timed_start  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for name, original in self._undo:
            setattr(LaunchedStep, name, original)


def instrument(llm: LLM, timer: PhaseTimer) -> None:
    """Wrap the phases of one engine step of `llm`."""
    engine, runner = llm.engine, llm.engine.runner
    scheduler = engine.scheduler
    timer.wrap(llm, "_step", "llm output")  # the offline API's detokenization, per step
    timer.wrap(engine, "step", "engine other")
    timer.wrap(scheduler, "schedule", "schedule")
    timer.wrap(scheduler, "may_draft", "schedule")
    timer.wrap(StepPlan, "build", "plan")
    if scheduler.host_proposer is not None:
        timer.wrap(scheduler.host_proposer, "propose", "propose")
    timer.wrap(model_runner, "lay_out", "inputs")
    timer.wrap(runner, "_device_inputs", "inputs")
    timer.wrap(runner.attention, "plan", "inputs")
    timer.wrap(runner, "launch", "launch other")
    timer.wrap(runner.staging, "upload", "inputs")
    if runner.graphs is not None:  # the replays are the forward; packing their inputs is not
        for name in ("pack_decode", "pack_verify"):
            timer.wrap(runner.graphs, name, "inputs")
        for name in ("run", "run_verify"):
            timer.wrap(runner.graphs, name, "forward")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "forward")
    timer.wrap(SamplingBatch, "from_rows", "sample")
    timer.wrap(Sampler, "__call__", "sample")
    timer.wrap(SpecDecoder, "sample", "verify")
    timer.wrap(LaunchedStep, "read", "read")
    timer.wrap(scheduler, "update", "update")
    timer.wrap(engine, "_finish", "engine other")


def _llm(config: str | None, spec: dict[str, Any] | None, batch: int, device: str) -> LLM:
    # Prefix caching on: the timed run's prompts were prefilled by the warm-up run before it, so
    # its steps are the decode or verify steps being measured (off, a batch of 64 re-prefilled
    # its 32,768 prompt tokens in 16 eager steps that counted in every phase's average).
    kwargs: dict[str, Any] = {"device": device, "seed": 0}
    if config is not None:
        kwargs.update(load_format="dummy", dtype="bfloat16" if device == "cuda" else "float32")
    return LLM(config or str(DEMO_MODEL_DIR), speculative_config=spec, max_num_seqs=batch,
               **kwargs)  # fmt: skip


def measure(
    config: str | None,
    batch: int,
    input_len: int,
    steps: int,
    k: int,
    rate: float | None,
    device: str = "cpu",
    adaptive: bool = False,
    kernels: int = 0,
) -> dict[str, Any]:
    """Per-step milliseconds and operators of each phase, plain (`rate` None) or oracle."""
    rng = np.random.default_rng(0)  # B4's prompts: random tokens
    prompts = [rng.integers(10, 1000, input_len).tolist() for _ in range(batch)]
    greedy = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    plain = _llm(config, None, batch, device)
    vocab = plain.config.model.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    llm = plain
    if rate is not None:  # the plain run's tokens, replayed at acceptance rate `rate`
        outputs = plain.generate(prompts, greedy, use_tqdm=False)
        continuations = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs,
                                                                          strict=True)}  # fmt: skip
        del plain, llm  # one engine's KV cache at a time on the GPU
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": adaptive}
        llm = _llm(config, spec, batch, device)
        oracle = OracleProposer(k, continuations, rate, vocab, 0)
        llm.engine.scheduler.host_proposer = oracle
        oracle.teacher_force(llm.engine.scheduler)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    cuda = device == "cuda"
    timed, seconds, launched, tokens = _run(llm, prompts, greedy, PhaseTimer(cuda))
    counted, *_ = _run(llm, prompts, greedy, PhaseTimer(cuda, count_ops=True))
    idle, idle_steps = _idle_seconds(llm, prompts, greedy, timed.clock)
    steps_run = len(launched)
    report_kernels = _kernel_us_per_step(llm, prompts, greedy, kernels) if kernels else {}
    per_step = {name: 1e3 * s / steps_run for name, s in sorted(timed.seconds.items())}
    host = sum(v for name, v in per_step.items() if name not in ("forward", "read"))
    return {
        "steps": steps_run,
        "tokens_per_step": tokens / steps_run / batch,
        "ms_per_step": 1e3 * seconds / steps_run,
        # Outside the forward pass and the read (on the GPU, the read waits for the step).
        "host_ms_per_step": host,
        # Host time while the device had nothing queued (`IdleGaps`): what overlapping the
        # step with the next would save.
        "idle_host_ms_per_step": 1e3 * idle / idle_steps,
        "device_ms_per_step": 1e3 * sum(s.forward_seconds() for s in launched) / steps_run,
        "phase_ms_per_step": per_step,
        # The forward pass is left out: CUDA graphs replay it in one launch.
        "torch_ops_per_step": {
            n: c / steps_run for n, c in sorted(counted.ops.items()) if c and n != "forward"
        },
        "kernel_us_per_step": report_kernels,
    }


def _kernel_us_per_step(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, top: int
) -> dict[str, list[float]]:
    """The `top` kernels by device time in one generation: name -> [us per step, launches per
    step], steps counted as the launches of the runner."""
    with _launches(llm, prompts) as launched, profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    steps = max(len(launched), 1)
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    return {e.key: [e.device_time_total / steps, e.count / steps] for e in rows}


@contextmanager
def _launches(llm: LLM, prompts: list[list[int]]) -> Iterator[list[LaunchedStep]]:
    """The steps `llm`'s runner launches inside the block, after a one-token generation of
    `prompts` before it (their prefill, which prefix caching keeps out of the block)."""
    runner = llm.engine.runner
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    launched: list[LaunchedStep] = []
    launch = runner.launch

    def kept(*args: Any, **kwargs: Any) -> LaunchedStep:
        launched.append(launch(*args, **kwargs))
        return launched[-1]

    runner.launch = kept  # type: ignore[method-assign]
    try:
        yield launched
    finally:
        del runner.launch


def _run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, timer: PhaseTimer
) -> tuple[PhaseTimer, float, list[LaunchedStep], int]:
    """One generation under `timer`: the timer, its seconds, the steps launched, tokens."""
    with _launches(llm, prompts) as launched:
        instrument(llm, timer)
        try:
            start = timer.clock()
            out = llm.generate(prompts, params, use_tqdm=False)
            seconds = timer.clock() - start
        finally:
            timer.restore()
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    return timer, seconds, launched, tokens


def _idle_seconds(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, clock: Callable[[], float]
) -> tuple[float, int]:
    """One generation with only `IdleGaps` installed (no phase timer's wrappers in the gaps):
    the idle host seconds, and the steps launched."""
    gaps = IdleGaps(clock)
    with _launches(llm, prompts) as launched:
        gaps.install()
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            gaps.uninstall()
    return gaps.seconds, len(launched)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a checkpoint (dummy weights)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens (as B4)")
    parser.add_argument("--steps", type=int, default=200, help="tokens per request")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--adaptive", action="store_true", help="adaptive speculation (B4's "
                        "oracle rows run without it)")  # fmt: skip
    parser.add_argument("--kernels", type=int, default=0, help="GPU: list the N kernels with "
                        "the most device time per step (a profiled third run)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # CPU times of one thread (see PhaseTimer)
    torch.manual_seed(0)
    np.random.seed(0)
    report = {
        mode: measure(
            args.config,
            args.batch,
            args.input_len,
            args.steps,
            args.k,
            rate,
            args.device,
            args.adaptive,
            args.kernels if args.device == "cuda" else 0,
        )
        for mode, rate in (("plain", None), ("verify", args.rate))
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    phases = sorted(set(report["plain"]["phase_ms_per_step"])
                    | set(report["verify"]["phase_ms_per_step"]))  # fmt: skip
    print(f"{'phase (ms per step)':22s} {'plain':>8s} {'verify':>8s}   torch ops plain / verify")
    for name in phases:
        row = [report[m]["phase_ms_per_step"].get(name, 0.0) for m in ("plain", "verify")]
        ops = [report[m]["torch_ops_per_step"].get(name, 0) for m in ("plain", "verify")]
        print(f"{name:22s} {row[0]:8.3f} {row[1]:8.3f}   {ops[0]:5.1f} / {ops[1]:5.1f}")
    for label in ("host_ms_per_step", "idle_host_ms_per_step", "device_ms_per_step",
                  "ms_per_step", "tokens_per_step", "steps"):  # fmt: skip
        print(f"{label:22s} {report['plain'][label]:8.3f} {report['verify'][label]:8.3f}")
    for mode in ("plain", "verify"):
        for name, (us, launches) in report[mode]["kernel_us_per_step"].items():
            print(f"kernel {mode:6s} {us:8.1f} us/step {launches:6.1f} launches/step  "
                  f"{name[:80]}")  # fmt: skip


if __name__ == "__main__":
    main()
