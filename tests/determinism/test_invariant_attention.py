"""`invariant_attention` (the Triton backend's deterministic kernel): correct against a float64
reference however a token is batched (decoded, prefilled in one chunk or in several, alone or
beside other sequences), and on CUDA bitwise the same in all those layouts.

Without CUDA it runs in Triton's interpreter (float32: the interpreter's bfloat16 `tl.dot` is
wrong, see tests/kernels), where `tl.dot` is NumPy's matmul, whose OpenBLAS kernel rounds a row
differently by its place in the tile (measured): there only closeness is checked. The GPU's
tensor-core products compute each row alone, which is what the bitwise check on CUDA tests
(`scripts/gpu_check.sh det`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.attention import (
    INVARIANT_CHUNK,
    INVARIANT_PARTS,
    invariant_attention,
    invariant_scratch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
PAGE = 16


class PagedKV:
    """Random K/V of some sequences on shuffled pages, with their page tables."""

    def __init__(self, lengths: list[int], hkv: int, d: int, dtype: torch.dtype, seed: int):
        gen = torch.Generator().manual_seed(seed)
        pages = [-(-n // PAGE) for n in lengths]
        order = torch.randperm(sum(pages) + 2, generator=gen).tolist()
        self.table = torch.zeros(len(lengths), max(pages), dtype=torch.int64)
        for i, n in enumerate(pages):
            self.table[i, :n] = torch.tensor(order[sum(pages[:i]) : sum(pages[: i + 1])])
        shape = ((sum(pages) + 2) * PAGE, hkv, d)
        self.k = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        self.v = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        self.table = self.table.to(DEVICE)

    def run(
        self, q: torch.Tensor, rows: list[tuple[int, int, int]], window: int | None,
        split: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Attention of `q` laid out as `rows` (sequence, query length, KV length), in order;
        `split`: a decode batch, each part of the keys in a program of its own."""
        q_lens = [ql for _, ql, _ in rows]
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE)
        kv = torch.tensor([kl for _, _, kl in rows], device=DEVICE)
        table = self.table[[seq for seq, _, _ in rows]]
        scale = q.shape[-1] ** -0.5
        scratch = invariant_scratch(len(rows), q.shape[1], q.shape[2], q.device) if split else None
        return invariant_attention(
            q, self.k, self.v, cu, kv, table, max(q_lens), PAGE, scale, window, scratch
        )


def _reference(kv: PagedKV, q: torch.Tensor, seq: int, kv_len: int, window: int | None):
    """float64 causal attention of `q` (the sequence's last positions) over its context."""
    pos = torch.arange(kv_len, device=DEVICE)
    slots = kv.table[seq, pos // PAGE] * PAGE + pos % PAGE
    group = q.shape[1] // kv.k.shape[1]
    k = kv.k[slots].double().repeat_interleave(group, dim=1)
    v = kv.v[slots].double().repeat_interleave(group, dim=1)
    q_pos = torch.arange(kv_len - q.shape[0], kv_len, device=DEVICE)
    s = torch.einsum("mhd,lhd->hml", q.double(), k) * q.shape[-1] ** -0.5
    keep = pos[None, :] <= q_pos[:, None]
    if window is not None:
        keep &= pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "window"), [(4, 4, 32, None), (6, 2, 64, 40), (8, 1, 32, None)]
)
def test_a_token_gets_the_same_output_however_it_is_batched(dtype, hq, hkv, d, window) -> None:
    lengths = [100, 70, 3]
    kv = PagedKV(lengths, hkv, d, dtype, seed=hq + d)
    gen = torch.Generator().manual_seed(7)
    queries = [torch.randn(n, hq, d, generator=gen).to(DEVICE, dtype) for n in lengths]
    # Sequence 0 in one chunk, alone: the reference layout.
    whole = kv.run(queries[0], [(0, 100, 100)], window)
    reference = _reference(kv, queries[0], 0, 100, window)
    _close(whole, reference, dtype)
    # In chunks of 37 (the rest of the context cached), beside other sequences' chunks.
    got = []
    for start in range(0, 100, 37):
        end = min(start + 37, 100)
        q = torch.cat([queries[1][:20], queries[0][start:end], queries[2]])
        out = kv.run(q, [(1, 20, 20), (0, end - start, end), (2, 3, 3)], window)
        got.append(out[20 : 20 + end - start])
    _same(torch.cat(got), whole, reference, dtype)
    # As decode rows (one query each) in batches of several sequences.
    for pos in (0, 64, 99):
        q = torch.cat([queries[2][2:3], queries[0][pos : pos + 1], queries[1][69:70]])
        out = kv.run(q, [(2, 1, 3), (0, 1, pos + 1), (1, 1, 70)], window)
        _same(out[1:2], whole[pos : pos + 1], reference[pos : pos + 1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "window"), [(8, 2, None), (4, 4, 300)])
def test_split_decode_gives_the_bits_of_one_program(dtype, hq, hkv, window) -> None:
    """A decode batch with each part of the keys in a program of its own (then merged) gives
    bitwise what one program folding every part gives (parts of several chunks: 4,500 keys
    dealt into INVARIANT_PARTS parts), at positions with empty parts, full ones, chunks cut
    short, and with a window."""
    assert INVARIANT_PARTS * INVARIANT_CHUNK * 64 < 4500
    kv = PagedKV([4500, 70], hkv, 32, dtype, seed=3)
    gen = torch.Generator().manual_seed(5)
    for pos in (0, 64, 700, 4499):
        q = torch.randn(2, hq, 32, generator=gen).to(DEVICE, dtype)
        rows = [(1, 1, 70), (0, 1, pos + 1)]
        one = kv.run(q, rows, window)
        assert torch.equal(kv.run(q, rows, window, split=True), one)
        _close(one[1:], _reference(kv, q[1:], 0, pos + 1, window), dtype)


def _close(out: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    err = (out.double() - reference).norm() / reference.norm()
    assert err < (2e-5 if dtype == torch.float32 else 2e-2), f"relative error {err:.2e}"


def _same(got: torch.Tensor, want: torch.Tensor, reference: torch.Tensor, dtype) -> None:
    """Bitwise `want` on CUDA; in the interpreter, as close to the reference as `want` is."""
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    _close(got, reference, dtype)


def test_triton_backend_in_deterministic_mode_matches_transformers(checkpoints) -> None:
    """The engine on the Triton backend's deterministic path (every batch through
    `invariant_attention`: chunked prefill, mixed and decode batches) gives transformers'
    greedy tokens (float32)."""
    from tests.conftest import hf_greedy
    from tokenmill import LLM, SamplingParams

    path = checkpoints["qwen3"]
    prompts = [list(range(3, 10)), list(range(20, 57)), [100, 200, 300]]
    llm = LLM(
        str(path), device=DEVICE, dtype="float32", attention_backend="triton", page_size=4,
        max_num_batched_tokens=16, deterministic=True,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 8) for p in prompts]
