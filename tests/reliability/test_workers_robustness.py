"""No request can end a worker: whatever goes wrong becomes an error for that request alone."""

from __future__ import annotations

import msgspec
import pytest

from tokenmill.intake import ContextLimits
from tokenmill.ipc.messages import (
    EngineRequest,
    EngineStats,
    EngineStep,
    NewRequest,
    RequestDelta,
    TokenizeRequest,
)
from tokenmill.ipc.sockets import encode
from tokenmill.sampling_params import MAX_SEED, SamplingParams
from tokenmill.testing.checkpoints import build_tokenizer
from tokenmill.tokenization.detokenizer_worker import Detokenizer
from tokenmill.tokenization.tokenizer_worker import TokenizerWorker

LIMITS = ContextLimits(vocab_size=512, max_model_len=64)
DEEP: list = []
for _ in range(900):  # within what msgpack and json.loads take, past what a template renders
    DEEP = [DEEP]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def worker(tokenizer) -> TokenizerWorker:
    return TokenizerWorker(tokenizer, LIMITS)


def _engine_requests(encoded: list[bytes]) -> list[EngineRequest]:
    return [msgspec.msgpack.decode(raw, type=EngineRequest) for raw in encoded]


def test_the_largest_seed_with_n_2_fans_out_instead_of_killing_the_worker(worker) -> None:
    # The reproducer of issue 17: choice 1's seed used to become 2**64 and crash msgpack.
    params = SamplingParams(max_tokens=2, n=2, seed=MAX_SEED)
    encoded, error = worker.handle(encode(TokenizeRequest("r", params, prompt="hi")))
    assert error is None
    requests = _engine_requests(encoded)
    assert [(r.request_id, r.params.seed) for r in requests] == [("r:0", MAX_SEED), ("r:1", 0)]


@pytest.mark.parametrize(
    ("fields", "status", "fragment"),
    [
        ({"prompt": [1, 10**6]}, 400, "token ids must be in [0, 512)"),
        ({"prompt": list(range(70))}, 400, "context window"),
        ({"prompt": 12}, 400, "Expected `str | array | null`"),  # refused by the struct
        ({"messages": [{"role": "user", "content": 3}]}, 400, "chat template"),
        (  # was a RecursionError: HTTP 500
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}],
            },
            400,
            "chat template",
        ),
    ],
)
def test_bad_input_is_a_400_for_that_request(worker, fields, status, fragment) -> None:
    params = msgspec.to_builtins(SamplingParams(max_tokens=4))
    message = {"type": "TokenizeRequest", "request_id": "bad", "params": params, **fields}
    encoded, error = worker.handle(msgspec.msgpack.encode(message))
    assert encoded == [] and error is not None
    assert (error.request_id, error.status) == ("bad", status) and fragment in error.message


def test_an_unexpected_failure_is_a_500_for_that_request_and_the_next_one_works(
    worker, monkeypatch
) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(worker.tokenizer, "encode", broken)
    request = TokenizeRequest("boom", SamplingParams(max_tokens=2), prompt="hi")
    encoded, error = worker.handle(encode(request))
    assert encoded == [] and error is not None
    assert error.status == 500 and "tokenizer bug" in error.message
    monkeypatch.undo()
    ok = TokenizeRequest("fine", SamplingParams(max_tokens=2), prompt="hi")
    assert len(worker.handle(encode(ok))[0]) == 1


def test_undecodable_bytes_are_dropped_without_an_answer(worker) -> None:
    assert worker.handle(b"\xc1 not msgpack") == ([], None)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"prompt": [2**64]}, "beyond 64 bits"),
        ({"prompt": "a\ud800b"}, "unpaired surrogate"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "unpaired surrogate"),
    ],
)
def test_values_msgpack_can_not_carry_are_refused_when_the_message_is_built(
    fields, fragment
) -> None:
    with pytest.raises(ValueError, match=fragment):
        TokenizeRequest("r", SamplingParams(), **fields)


def _stats() -> EngineStats:
    return EngineStats(0, 0, 0, 1, 0, 0, 0, {}, 0, 0, {}, engine_pid=1)


def test_a_token_the_detokenizer_can_not_decode_fails_only_its_request(tokenizer) -> None:
    detok = Detokenizer(tokenizer)
    params = SamplingParams(max_tokens=8)
    ok_ids = tokenizer.encode(" fine", add_special_tokens=False)
    step = EngineStep(
        new_requests=[NewRequest("good:0", [1], params), NewRequest("bad:0", [1], params)],
        deltas=[
            RequestDelta("good:0", ok_ids, None, None, 1, 0),
            RequestDelta("bad:0", [-1], None, None, 1, 0),  # decode raises OverflowError
        ],
        errors=[],
        stats=_stats(),
    )
    batch, stopped, failed = detok.process(step)
    assert [o.request_id for o in batch.outputs] == ["good:0"]
    assert batch.outputs[0].text == " fine"
    assert [(e.request_id, e.status) for e in batch.errors] == [("bad:0", 500)]
    assert failed == ["bad:0"] and stopped == []
    assert batch.started == ["good:0", "bad:0"]
    assert set(detok.streams) == {"good:0"}
    # The good request carries on.
    later = EngineStep([], [RequestDelta("good:0", ok_ids, None, "length", 1, 0)], [], _stats())
    assert detok.process(later)[0].outputs[0].finish_reason == "length"


def test_a_restarted_engine_core_drops_the_old_streams(tokenizer) -> None:
    detok = Detokenizer(tokenizer)
    new = NewRequest("old:0", [1], SamplingParams())
    detok.process(EngineStep([new], [], [], _stats()))
    assert set(detok.streams) == {"old:0"}
    restarted = EngineStats(0, 0, 0, 1, 0, 0, 0, {}, 0, 0, {}, engine_pid=2)
    detok.process(EngineStep([], [], [], restarted))
    assert detok.streams == {}


def test_prompt_logprobs_reach_the_server_with_texts_once(tokenizer) -> None:
    detok = Detokenizer(tokenizer)
    prompt = tokenizer.encode("a cat", add_special_tokens=False)
    new = NewRequest("p:0", prompt, SamplingParams(prompt_logprobs=1))
    scores = [None, *[[(t, -1.0, 2), (4, -0.5, 1)] for t in prompt[1:]]]
    first = RequestDelta("p:0", [5], None, None, len(prompt), 0, prompt_logprobs=scores)
    (out,) = detok.process(EngineStep([new], [first], [], _stats()))[0].outputs
    assert out.prompt_logprobs is not None
    assert out.prompt_logprobs.first_token == (prompt[0], tokenizer.decode([prompt[0]]))
    assert len(out.prompt_logprobs.entries) == len(prompt) - 1 >= 1
    decode = tokenizer.decode
    expected = [(prompt[1], decode([prompt[1]]), -1.0, 2), (4, decode([4]), -0.5, 1)]
    assert out.prompt_logprobs.entries[0] == expected
    assert detok.first_tokens == {}  # sent once, with the first output
    later = RequestDelta("p:0", [6], None, "length", len(prompt), 0)
    assert (
        detok.process(EngineStep([], [later], [], _stats()))[0].outputs[0].prompt_logprobs is None
    )
