"""The draft-model proposer drafts the draft checkpoint's own greedy continuation (checked
against transformers), in the target's pages, after mirroring prefill and verify batches."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import hf_greedy, hf_logprobs
from tokenmill.attention.backend import AttentionInputs
from tokenmill.batch import SamplingRows
from tokenmill.config import ModelConfig
from tokenmill.runner.sampler import Sampler, SamplingBatch
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.draft_model import DraftModelProposer

K = 3
PROMPTS = [[5, 9, 14, 3, 7], list(range(40, 57)), [11, 2, 2, 8, 30, 31, 9, 4, 6]]


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, None]:
    return logits.argmax(dim=-1), None


def _mirror(
    proposer: DraftModelProposer, rows: list[list[int]], starts: list[int], table: np.ndarray
) -> None:
    """Run the draft over `rows[i]` at positions `starts[i]...`, as the target's batch would."""
    ps = proposer.page_size
    q_lens = [len(r) for r in rows]
    positions = np.concatenate(
        [np.arange(s, s + len(r)) for s, r in zip(starts, rows, strict=True)]
    )
    seq = np.repeat(np.arange(len(rows)), q_lens)
    slots = table[seq, positions // ps] * ps + positions % ps
    kv_lens = [s + len(r) for s, r in zip(starts, rows, strict=True)]

    def t(a) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=torch.int64)

    inputs = AttentionInputs(
        query_lens_cpu=q_lens,
        kv_lens_cpu=kv_lens,
        cu_query_lens=t(np.concatenate([[0], np.cumsum(q_lens)])),
        kv_lens=t(kv_lens),
        page_table=t(table),
        slot_mapping=t(slots),
    )
    proposer.mirror(t(np.concatenate(rows)), t(positions), inputs)


@pytest.mark.parametrize("page_size", [1, 16])
def test_drafts_are_the_drafts_greedy_continuation(draft_dir: Path, page_size: int) -> None:
    draft = ModelConfig.from_pretrained(draft_dir)
    width = -(-64 // page_size)
    num_pages = len(PROMPTS) * width + 3
    proposer = DraftModelProposer(draft, K, num_pages, page_size, torch.device("cpu"), "torch", 8)
    # Rows own interleaved, shuffled pages: a wrong slot would read another row's K/V.
    pages = np.random.default_rng(0).permutation(num_pages)[: len(PROMPTS) * width]
    table = pages.reshape(width, len(PROMPTS)).T.copy()

    _mirror(proposer, PROMPTS, [0] * len(PROMPTS), table)  # the target's prefill
    newest = [20, 21, 22]  # the tokens the target sampled after each prompt
    num_drafts = np.array([K, 1, 2])
    drafts = proposer.propose(
        torch.tensor(newest), np.array([len(p) for p in PROMPTS]), num_drafts, table, _greedy
    )
    histories = []
    for row, prompt in enumerate(PROMPTS):
        expected = hf_greedy(draft_dir, [*prompt, newest[row]], int(num_drafts[row]))
        assert drafts.token_ids[row, : num_drafts[row]].tolist() == expected
        histories.append([*prompt, newest[row]])

    # The target verifies [newest, drafts...]; the draft mirrors that batch too. Say row r
    # accepted r drafts and then sampled 30 + r: the next proposal continues from there.
    verify = [[newest[r], *drafts.token_ids[r, : num_drafts[r]].tolist()] for r in range(3)]
    _mirror(proposer, verify, [len(p) for p in PROMPTS], table)
    accepted = [min(r, int(num_drafts[r])) for r in range(3)]
    histories = [h + v[1 : 1 + a] + [30 + r] for r, (h, v, a) in enumerate(
        zip(histories, verify, accepted, strict=True))]  # fmt: skip
    again = proposer.propose(
        torch.tensor([30, 31, 32]),
        np.array([len(h) - 1 for h in histories]),
        np.array([K, K, K]),
        table,
        _greedy,
    )
    for row, history in enumerate(histories):
        assert again.token_ids[row].tolist() == hf_greedy(draft_dir, history, K)

    # The draft's cache now holds what one pass over each full sequence would write.
    full = [h + again.token_ids[r, : K - 1].tolist() for r, h in enumerate(histories)]
    fresh = DraftModelProposer(draft, K, num_pages, page_size, torch.device("cpu"), "torch", 8)
    _mirror(fresh, full, [0] * len(full), table)
    for row, tokens in enumerate(full):
        positions = np.arange(len(tokens))
        slots = torch.from_numpy(
            table[row, positions // page_size] * page_size + positions % page_size
        )
        ours, ref = proposer.kv_cache, fresh.kv_cache
        for cached, expected in zip([*ours.k, *ours.v], [*ref.k, *ref.v], strict=True):
            torch.testing.assert_close(cached.flatten(0, 1)[slots], expected.flatten(0, 1)[slots])


def test_sampled_drafts_come_with_the_drafts_distributions(draft_dir: Path) -> None:
    """q at position j is the draft model's distribution after the drafts before j (checked
    with transformers), and each draft lies in its support."""
    draft = ModelConfig.from_pretrained(draft_dir)
    proposer = DraftModelProposer(draft, K, 8, 16, torch.device("cpu"), "torch", 8)
    table = np.array([[3, 5]])
    prompt = PROMPTS[1]
    _mirror(proposer, [prompt], [0], table)
    params = SamplingParams(temperature=1.0, top_k=50, seed=3)
    batch = SamplingBatch.from_rows(
        SamplingRows(params=[params], token_index=[0]), draft.vocab_size, torch.device("cpu")
    )
    sampler = Sampler(torch.device("cpu"), seed=0)
    drafts = proposer.propose(
        torch.tensor([20]), np.array([len(prompt)]), np.array([K]), table,
        partial(sampler.sample_with_distribution, batch=batch),
    )  # fmt: skip
    assert drafts.probs is not None
    history = [*prompt, 20]
    for j in range(K):
        logits = hf_logprobs(draft_dir, history)[-1]
        top = logits.topk(50)
        expected = torch.zeros_like(logits).index_put_((top.indices,), top.values.softmax(-1))
        torch.testing.assert_close(drafts.probs[0, j], expected, atol=1e-5, rtol=1e-4)
        token = int(drafts.token_ids[0, j])
        assert expected[token] > 0
        history.append(token)
