"""`LLM` left midway: an interrupted `generate`, a dropped stream, two threads; the engine is
left idle with its pages free, and the next call answers as a fresh one would."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints import llm as llm_module

PROMPTS = [list(range(30, 50)), list(range(60, 75)), list(range(90, 110))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", max_model_len=64)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return _greedy(llm)


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished() and llm.engine.request_ids() == []
    assert llm.engine.cache.num_used_pages == 0 and not llm._children


class _InterruptingBar(llm_module.tqdm):
    """A progress bar whose first update raises, as Ctrl-C during `generate` does."""

    def update(self, n: float | None = 1) -> bool | None:
        raise KeyboardInterrupt


def test_interrupted_generate_aborts_its_requests(
    llm: LLM, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm_module, "tqdm", _InterruptingBar)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, long)
    monkeypatch.undo()
    _assert_idle(llm)
    assert _greedy(llm) == reference


def test_a_stream_dropped_before_its_first_output_aborts_its_request(
    llm: LLM, reference: list[list[int]]
) -> None:
    stream = llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))
    assert llm.engine.has_unfinished()  # queued when made
    del stream
    gc.collect()
    _assert_idle(llm)
    assert _greedy(llm) == reference


def test_generate_from_two_threads_takes_turns(llm: LLM, reference: list[list[int]]) -> None:
    answers: dict[int, list[list[int]] | BaseException] = {}

    def run(k: int) -> None:
        try:
            answers[k] = _greedy(llm)
        except Exception as e:  # recorded: the assertion below shows it
            answers[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert answers == {0: reference, 1: reference}
    _assert_idle(llm)
