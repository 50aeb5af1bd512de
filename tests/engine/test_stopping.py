"""When requests end: stop tokens, stop strings, EOS, min/max tokens, context limit, abort."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams, intake
from tokenmill.batch import FinishReason
from tokenmill.engine import engine_core

PROMPT = list(range(30, 50))


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", max_model_len=64)


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[int]:
    return hf_greedy(llama_dir, PROMPT, 30)


def _first_new_index(tokens: list[int], start: int) -> int:
    """Index of the first token at or after `start` that does not occur earlier."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_stop_token_id_ends_with_finish_reason_stop(llm: LLM, reference: list[int]) -> None:
    i = _first_new_index(reference, 3)
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[reference[i]])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[: i + 1]
    assert out.finish_reason == "stop"


def test_min_tokens_suppresses_stop_tokens(llm: LLM, reference: list[int]) -> None:
    i = _first_new_index(reference, 2)
    params = SamplingParams(
        temperature=0, max_tokens=30, min_tokens=i + 3, stop_token_ids=[reference[i]]
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert reference[i] not in out.token_ids[: i + 3]
    assert len(out.token_ids) >= i + 3


def test_stop_string_truncates_text_and_ends_request(llm: LLM, reference: list[int]) -> None:
    tokenizer = llm.get_tokenizer()
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[10:13]
    assert stop and stop not in text[:10]
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 30
    assert stop in tokenizer.decode(out.token_ids)
    params = SamplingParams(
        temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True
    )
    kept = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_max_tokens_ends_with_length(llm: LLM, reference: list[int]) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[:5]
    assert out[0].outputs[0].finish_reason == "length"


def test_context_window_caps_generation(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert len(PROMPT) + len(out.token_ids) == 64
    assert out.finish_reason == "length"


def test_prompt_longer_than_context_window_is_rejected_and_nothing_queued(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt has 64 tokens.*max_model_len.*64"):
        llm.generate([PROMPT, list(range(64))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "at least one token"), ([10**6], "token ids must be in"), (["a", 1], "integer")],
)
def test_bad_prompts_are_rejected(llm: LLM, prompt: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)


def test_text_with_an_unpaired_surrogate_is_a_value_error(llm: LLM) -> None:
    # The tokenizer's own error was a TypeError naming no field (a traceback from the CLI, whose
    # arguments carry undecodable bytes as surrogates).
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="prompt must be valid Unicode"):
        llm.generate(["a \ud800"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be valid Unicode"):
        llm.stream("a \udcff", params)
    with pytest.raises(ValueError, match="messages must be valid Unicode"):
        llm.chat([{"role": "user", "content": "a \ud800"}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("messages", ["hi", ["hi"], [[{"role": "user", "content": "hi"}]]])
def test_stream_chat_checks_its_messages_as_chat_does(llm: LLM, messages: object) -> None:
    with pytest.raises(ValueError, match="messages must be a list of message dicts"):
        llm.stream_chat(messages, SamplingParams(max_tokens=2))  # type: ignore[arg-type]


def test_generate_checks_each_prompt_once(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # A second pass over every id (the engine repeating `intake.prepare`'s check) idled the
    # GPU for ~0.2 s before the first step of 512 long prompts; a direct engine user still
    # gets the engine's own check.
    checked: list[int] = []
    check = intake.check_prompt

    def counting(ids: list[int], *args: object) -> object:
        checked.append(len(ids))
        return check(ids, *args)

    monkeypatch.setattr(intake, "check_prompt", counting)
    monkeypatch.setattr(engine_core, "check_prompt", counting)
    llm.generate([PROMPT, PROMPT[:7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert sorted(checked) == [7, len(PROMPT)]
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.engine.add_request("direct", [10**6], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_eos_from_config_stops_unless_ignored(
    llama_dir: Path, tmp_path: Path, reference: list[int]
) -> None:
    # The tiny model rarely picks its own EOS, so declare a token it does pick as EOS.
    checkpoint = tmp_path / "eos"
    shutil.copytree(llama_dir, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["eos_token_id"] = [reference[4], 12345]
    (checkpoint / "config.json").write_text(json.dumps(config))
    engine = LLM(str(checkpoint), device="cpu").engine
    engine.add_request("eos", PROMPT, SamplingParams(temperature=0, max_tokens=30))
    assert _drain(engine)["eos"] == (reference[:5], FinishReason.STOP)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("ignore", PROMPT, params)
    assert _drain(engine)["ignore"] == (reference[:8], FinishReason.LENGTH)


def _drain(engine) -> dict[str, tuple[list[int], FinishReason]]:
    tokens: dict[str, list[int]] = {}
    done: dict[str, tuple[list[int], FinishReason]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = (tokens[out.request_id], out.finish_reason)
    return done


def test_abort_frees_pages_and_reports_abort(llm: LLM) -> None:
    engine = llm.engine
    cache = engine.cache
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("b", PROMPT[:5], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    assert cache.num_used_pages > 0
    final = engine.abort_request("a")
    assert final is not None and final.finish_reason is FinishReason.ABORT
    assert engine.abort_request("a") is None  # already gone
    assert engine.abort_request("b") is not None
    assert not engine.has_unfinished()
    assert cache.num_used_pages == 0


def test_duplicate_request_id_is_rejected(llm: LLM) -> None:
    llm.engine.add_request("dup", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already running"):
        llm.engine.add_request("dup", PROMPT, SamplingParams(max_tokens=2))
    llm.engine.abort_request("dup")


def test_a_stream_grows_one_output_to_what_generate_returns(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    seen = [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in llm.stream(PROMPT, params)]
    assert [n for _, n in seen] == list(range(1, 13))  # one yield per token on the CPU
    assert all(later.startswith(text) for (text, _), (later, _) in itertools.pairwise(seen))
    assert seen[-1][0] == expected.text


def test_a_step_whose_requests_were_aborted_while_it_ran_is_still_read(llm: LLM) -> None:
    """Overlap scheduling leaves the newest step unread; if its requests are aborted meanwhile,
    `has_unfinished` is false but the step still counts: the server's loop steps once more
    (`step_in_flight`), which reads it, so every launched step's device time is counted."""
    engine = llm.engine
    assert engine.config.runner.overlap_scheduling
    launched, read = engine.stats.step_seconds_by_kind, engine.stats.forward_seconds
    before = (sum(h.count for h in launched.values()), read.count)
    engine.add_request("gone", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.abort_request("gone")
    assert not engine.has_unfinished() and engine.step_in_flight
    assert engine.step() == [] and not engine.step_in_flight
    after = (sum(h.count for h in launched.values()), read.count)
    assert after[0] - before[0] == after[1] - before[1] == 1


def test_closing_a_stream_aborts_its_request_and_frees_its_pages(llm: LLM) -> None:
    stream = llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    first = next(stream)
    next(stream)
    stream.close()
    assert not first.finished and len(first.outputs[0].token_ids) == 2
    assert not llm.engine.has_unfinished()
    assert llm.engine.cache.num_used_pages == 0


def test_closing_a_stream_before_its_first_output_aborts_its_request(llm: LLM) -> None:
    stream = llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert llm.engine.has_unfinished()  # queued when made
    stream.close()
    assert not llm.engine.has_unfinished() and not llm._children
    assert list(stream) == []


def test_a_stream_finished_by_another_callers_steps_still_yields_its_end(llm: LLM) -> None:
    """`generate` steps the engine for every request: the stream's request finishes inside
    it, and the stream's next (and last) yield is that finished output, as its docstring says."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    stream = llm.stream(PROMPT, params)
    first = next(stream)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    rest = list(stream)
    assert [o is first for o in rest] == [True] and first.finished
    assert len(first.outputs[0].token_ids) == 3
