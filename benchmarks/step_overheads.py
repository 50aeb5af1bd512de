"""What each piece around a decode graph replay costs on the GPU, step after step.

Replays a batch-1 decode graph back to back (the host queues far ahead, as overlap scheduling
does), adding one by one the operations a decode step runs around it: the input-filling
kernel, the host→device copy of the step's inputs, the greedy argmax, the device→host copy of
the token, and variants (copies on a side stream, the filling kernel reading pinned host memory
directly, PDL off). Prints the GPU time per step of each.

python benchmarks/step_overheads.py --config shared/models/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.argmax import argmax_rows
from tokenmill.kernels.graph_inputs import fill_decode_inputs
from tokenmill.kernels.pdl import set_pdl_enabled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    llm = LLM(
        args.config, load_format="dummy", dtype="bfloat16", max_num_seqs=8,
        kv_cache_memory_bytes=20_000_000_000, enable_prefix_caching=False, max_model_len=4096,
    )  # fmt: skip
    engine = llm.engine
    graphs = engine.runner.graphs
    assert graphs is not None
    prompt = np.random.default_rng(0).integers(10, llm.config.model.vocab_size, 640).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(8):
        engine.step()
    static = (graphs.input_ids, graphs.positions, graphs.slots, graphs.kv_lens, graphs.page_table)
    width = int(graphs.kv_lens[0].item()) // engine.runner.page_size + 1
    inputs = (*(t[:1].clone() for t in static[:4]), static[4][:1, :width].clone())
    row_src = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    sampled = torch.zeros(1, dtype=torch.int64, device="cuda")
    sizes = [1, 1, 1, 1, width, 1]
    pinned = torch.zeros(sum(sizes), dtype=torch.int64).pin_memory()
    for part, t in zip(pinned.split(sizes), [*inputs, row_src], strict=True):
        part.copy_(t.reshape(-1))
    host_parts = [p.view(t.shape) for p, t in zip(pinned.split(sizes), [*inputs, row_src],
                                                   strict=True)]  # fmt: skip
    token_host = torch.zeros(1, dtype=torch.int64).pin_memory()
    graph, logits = graphs.graphs[1], graphs.logits[1]
    side = torch.cuda.Stream()

    def fill(parts: list[torch.Tensor]) -> None:
        fill_decode_inputs(tuple(parts[:5]), parts[5], sampled, static, 1)

    def h2d() -> list[torch.Tensor]:
        flat = pinned.to("cuda", non_blocking=True)
        return [p.view(t.shape) for p, t in zip(flat.split(sizes), host_parts, strict=True)]

    def d2h(tokens: torch.Tensor) -> None:
        token_host.copy_(tokens, non_blocking=True)

    def side_copies() -> None:
        ready = torch.cuda.Event()
        side.wait_stream(torch.cuda.current_stream())  # previous step's argmax
        with torch.cuda.stream(side):
            d2h(sampled)
            flat = pinned.to("cuda", non_blocking=True)
            ready.record()
        torch.cuda.current_stream().wait_event(ready)
        flat.record_stream(torch.cuda.current_stream())
        parts = [p.view(t.shape) for p, t in zip(flat.split(sizes), host_parts, strict=True)]
        fill(parts)
        graph.replay()
        torch.argmax(logits, dim=-1, out=sampled)

    variants: list[tuple[str, Callable[[], object]]] = [
        ("replay only", graph.replay),
        ("fill + replay", lambda: (fill([*inputs, row_src]), graph.replay())),
        ("h2d + fill + replay", lambda: (fill(h2d()), graph.replay())),
        ("h2d + fill + replay + argmax",
         lambda: (fill(h2d()), graph.replay(), torch.argmax(logits, -1, out=sampled))),
        ("h2d + fill + replay + argmax + d2h",
         lambda: (fill(h2d()), graph.replay(), torch.argmax(logits, -1, out=sampled),
                  d2h(sampled))),
        ("h2d + fill + replay + Triton argmax + d2h",
         lambda: (fill(h2d()), graph.replay(), sampled.copy_(argmax_rows(logits)), d2h(sampled))),
        ("fill from pinned (zero-copy) + replay + argmax + d2h",
         lambda: (fill(host_parts), graph.replay(), torch.argmax(logits, -1, out=sampled),
                  d2h(sampled))),
        ("copies on a side stream + fill + replay + argmax", side_copies),
    ]  # fmt: skip
    for pdl in (True, False):
        set_pdl_enabled(pdl)
        for name, fn in variants:
            try:
                gpu, host = _per_step(fn, args.steps)
            except Exception as exc:  # e.g. triton refusing a pinned host pointer
                print(f"step{'' if pdl else ' (no PDL)'}: {name}: failed ({exc!r:.120})")
                continue
            print(f"step{'' if pdl else ' (no PDL)'}: {name}: {1e3 * gpu:.3f} ms GPU, "
                  f"{1e3 * host:.3f} ms host per step")  # fmt: skip


def _per_step(fn: Callable[[], object], steps: int) -> tuple[float, float]:
    """GPU and host seconds per call of `fn` over `steps` calls queued back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / steps
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / steps, host


if __name__ == "__main__":
    main()
