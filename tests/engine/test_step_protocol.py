"""The step protocol as data: what the scheduler's `StepPlan` says, and how the runner lays it out.

No model runs here: the scheduler works on a real `CacheManager`, and the tests play the
engine core's part (launch = schedule, read = update) to check each field of the record.
"""

from __future__ import annotations

import numpy as np

from tokenmill.batch import Request, SamplingRows, ScheduledSeq, StepPlan
from tokenmill.cache.cache_manager import CacheManager
from tokenmill.config import SchedulerConfig
from tokenmill.engine.engine_core import step_kind
from tokenmill.engine.scheduler import Scheduler
from tokenmill.runner.model_runner import lay_out
from tokenmill.sampling_params import SamplingParams

PAGE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _scheduler(budget: int = 64, num_pages: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(config, CacheManager(num_pages, PAGE, enable_prefix_caching=False))


def _request(rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> Request:
    return Request(rid, prompt, params, eos_token_ids=(2,), max_model_len=64)


def test_prefill_rows_are_known_on_the_host_and_sample_at_their_end() -> None:
    sched = _scheduler(budget=8)
    a, b = _request("a", [10, 11, 12]), _request("b", list(range(20, 30)))
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule().plan
    assert plan is not None
    # a: all 3 tokens, samples; b: a 5-token chunk of 10, does not sample.
    assert plan.input_ids.tolist() == [10, 11, 12, 20, 21, 22, 23, 24]
    assert plan.input_src.tolist() == [-1] * 8
    assert plan.query_lens.tolist() == [3, 5] and plan.kv_lens.tolist() == [3, 5]
    assert plan.num_samples.tolist() == [1, 0]
    assert plan.sample_offsets.tolist() == [0, 1]
    assert plan.page_table.shape == (2, 2) and plan.page_table[0, 1] == 0  # a needs one page
    assert plan.sampling.token_index == [0]
    assert not plan.blocking
    assert (a.num_computed_tokens, b.num_computed_tokens) == (3, 5)  # counted at scheduling


def test_an_unread_token_comes_from_the_device() -> None:
    """Overlap: step 2 is scheduled before step 1's tokens are read."""
    sched = _scheduler()
    a, b = _request("a", [10, 11, 12]), _request("b", [20, 21])
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    assert first.plan is not None
    unread = {s.request: range(o, o + s.num_samples) for s, o in _offsets(first)}
    second = sched.schedule(unread)
    plan = second.plan
    assert plan is not None
    assert plan.input_src.tolist() == [0, 1]  # both inputs are step 1's samples...
    assert plan.input_ids.tolist() == [0, 0]  # ...so the host has no ids for them
    assert plan.kv_lens.tolist() == [4, 3] and plan.num_samples.tolist() == [1, 1]
    # The second draw of each request: its first token is unread but counted.
    assert plan.sampling.token_index == [1, 1]
    assert [s.device_tokens for s in second.seqs] == [range(0, 1), range(1, 2)]
    # Reading step 1 appends its tokens; step 3 (after step 2 is read) knows them on the host.
    sched.update(first, [7, 8], [None, None])
    sched.update(second, [9, 5], [None, None])
    third = sched.schedule()
    assert third.plan is not None
    assert third.plan.input_ids.tolist() == [9, 5] and third.plan.input_src.tolist() == [-1, -1]
    assert a.output_token_ids == [7, 9] and b.output_token_ids == [8, 5]


def test_a_request_ending_with_its_unread_token_is_not_scheduled() -> None:
    sched = _scheduler()
    a = _request("a", [10, 11], SamplingParams(max_tokens=1, temperature=0))
    sched.add_request(a)
    first = sched.schedule()
    assert sched.schedule({a: range(0, 1)}).plan is None
    sched.update(first, [3], [None])
    assert a.is_finished and not sched.has_unfinished()


def test_penalties_make_a_step_blocking_and_carry_the_tokens_they_count() -> None:
    sched = _scheduler()
    params = SamplingParams(repetition_penalty=1.2, max_tokens=4, min_tokens=2)
    sched.add_request(_request("p", [10, 11], params))
    sched.add_request(_request("g", [12]))
    plan = sched.schedule().plan
    assert plan is not None and plan.blocking
    assert plan.sampling.history == {0: ([10, 11], [])}  # the greedy row carries no history
    assert plan.sampling.suppressed == {0: (2,)}  # eos banned before min_tokens


def test_lay_out_samples_the_last_positions_of_each_row() -> None:
    """Rows sampling 0, 1 and 3 tokens (a chunk, a decode, a verify of 2 drafts)."""
    req = _request("x", [1])
    rows = [
        ScheduledSeq(req, 0, 4, 0),
        ScheduledSeq(req, 4, 1, 1),
        ScheduledSeq(req, 0, 3, 3),
    ]
    plan = StepPlan(
        input_ids=np.arange(8, dtype=np.int64),
        input_src=np.full(8, -1, dtype=np.int64),
        query_lens=np.array([s.num_new_tokens for s in rows]),
        kv_lens=np.array([4, 5, 3]),
        num_samples=np.array([s.num_samples for s in rows]),
        page_table=np.array([[3, 0], [3, 5], [7, 0]]),
        sampling=SamplingRows([GREEDY] * 4, [0] * 4),
    )
    host = lay_out(plan, PAGE)
    assert host.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert host.slots.tolist() == [12, 13, 14, 15, 20, 28, 29, 30]
    assert host.logits_index.tolist() == [4, 5, 6, 7]
    assert plan.sample_offsets.tolist() == [0, 0, 1]


def _offsets(out):  # type: ignore[no-untyped-def]
    assert out.plan is not None
    return zip(out.seqs, out.plan.sample_offsets.tolist(), strict=True)


def test_step_kinds_tell_prefill_mixed_and_decode_steps() -> None:
    """`step_kind` (the device time by kind in the engine's stats): prompt chunks only, a chunk
    beside a decode row, decode rows only."""
    sched = _scheduler(budget=8)
    a, b = _request("a", [10, 11, 12]), _request("b", list(range(20, 30)))
    sched.add_request(a)
    sched.add_request(b)
    kinds = []
    for _ in range(3):
        batch = sched.schedule()
        kinds.append(step_kind(batch))
        sampled = sum(s.num_samples for s in batch.seqs)
        sched.update(batch, [4] * sampled, [None] * sampled)
    # 3 + 5 tokens (both prompts' chunks); a decodes beside b's last 5; both decode.
    assert kinds == ["prefill", "mixed", "decode"]


def _rows(out) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.seqs]


def test_a_long_prompt_waits_a_step_rather_than_split() -> None:
    """With `whole_prompt_min_tokens` (a backend whose whole prompts attend faster), a prompt
    of at least that many tokens and no cached prefix that does not fit what other prompts
    left of a step waits for the next one, whole, where a split would have put its last chunk
    anyway, and the prompts behind it that fit what is left whole fill the step; once (then it
    is split as any prompt), not behind decodes alone (the next step has no more room), not
    when shorter than the bound or longer than a step's budget."""
    sched = _scheduler(budget=16, num_pages=64)
    sched.whole_prompt_min_tokens = 8
    a, b, c, d = (
        _request(r, list(range(10, 10 + n))) for r, n in (("a", 10), ("b", 12), ("c", 7), ("d", 5))
    )
    for req in (a, b, c, d):
        sched.add_request(req)
    first = sched.schedule()
    # a whole; b (12 tokens: at least 8, fits 16, not the 6 left) waits; c (7) does not fit
    # the 6 left whole, d (5) does
    assert _rows(first) == [("a", 0, 10), ("d", 0, 5)]
    assert b.waited_whole and b.num_computed_tokens == 0 and list(sched.waiting) == [b, c]
    sched.update(first, [5, 6], [None, None])
    second = sched.schedule()
    # the decodes, b whole (where its last chunk would have been), c's first 2 tokens (short)
    assert _rows(second) == [("a", 10, 1), ("d", 5, 1), ("b", 0, 12), ("c", 0, 2)]

    # once: a second time it is split as any prompt
    sched = _scheduler(budget=16, num_pages=64)
    sched.whole_prompt_min_tokens = 8
    a, b = _request("a", list(range(10, 20))), _request("b", list(range(30, 42)))
    b.waited_whole = True
    sched.add_request(a)
    sched.add_request(b)
    assert _rows(sched.schedule()) == [("a", 0, 10), ("b", 0, 6)]

    # behind decodes alone: split (the next step would have no more room)
    sched = _scheduler(budget=16, num_pages=64)
    sched.whole_prompt_min_tokens = 8
    a = _request("a", list(range(10, 13)))
    sched.add_request(a)
    sched.update(sched.schedule(), [5], [None])
    d = _request("d", list(range(40, 56)))  # 16 tokens: the whole budget, 15 left
    sched.add_request(d)
    assert _rows(sched.schedule()) == [("a", 3, 1), ("d", 0, 15)]
    assert not d.waited_whole

    # longer than a step's budget less a row for each running request (16 - 1 here), or
    # shorter than the bound: split as before
    for n, least in ((17, 8), (16, 8), (12, 13)):
        sched = _scheduler(budget=16, num_pages=64)
        sched.whole_prompt_min_tokens = least
        a, e = _request("a", list(range(10, 20))), _request("e", list(range(30, 30 + n)))
        sched.add_request(a)
        sched.add_request(e)
        assert _rows(sched.schedule()) == [("a", 0, 10), ("e", 0, 6)]


def test_prompts_that_fill_a_step_leave_the_waiting_prompt_its_room() -> None:
    """The prompts that fill a step behind one that waits whole (`Scheduler._admit_whole`)
    leave it what it needs to run whole in the next step (a sequence slot, its pages), and a
    request whose token is in flight is not admitted."""

    def run(max_num_seqs: int = 8, num_pages: int = 64, flying: str = "") -> list[list]:
        """Two steps of a 10-token prompt, a 12-token one that waits, a 5-token one."""
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16)
        sched = Scheduler(config, CacheManager(num_pages, PAGE, enable_prefix_caching=False))
        sched.whole_prompt_min_tokens = 8
        reqs = [_request(r, list(range(10, 10 + n))) for r, n in (("a", 10), ("b", 12), ("d", 5))]
        for req in reqs:
            sched.add_request(req)
        first = sched.schedule({req: range(0, 1) for req in reqs if req.request_id == flying})
        sched.update(first, [5] * len(first.seqs), [None] * len(first.seqs))
        return [_rows(first), _rows(sched.schedule())]

    assert run() == [[("a", 0, 10), ("d", 0, 5)], [("a", 10, 1), ("d", 5, 1), ("b", 0, 12)]]
    # two sequences at most: d would take b's slot
    assert run(max_num_seqs=2) == [[("a", 0, 10)], [("a", 10, 1), ("b", 0, 12)]]
    # 7 pages of 4 tokens: a takes 3, b needs 3, d's 2 would leave 2 (then d's first chunk)
    assert run(num_pages=7) == [[("a", 0, 10)], [("a", 10, 1), ("b", 0, 12), ("d", 0, 3)]]
    # d's token in flight (preempted as it was sampled): not admitted until it lands
    assert run(flying="d")[0] == [("a", 0, 10)]
