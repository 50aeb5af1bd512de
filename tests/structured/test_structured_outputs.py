"""Structured outputs offline: every output of a random model at temperature 1 parses and
validates, with batching, overlap scheduling, preemption and grammar compiles off the step."""

from __future__ import annotations

import gc
import json
import re
import shutil
import time
import weakref
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.structured.schemas import SCHEMAS
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.batch import SamplingRows
from tokenmill.runner.sampler import GrammarMask, Sampler, SamplingBatch
from tokenmill.structured.compiler import grammar_vocab_size

SEEDS = range(8)
PROMPTS = ["Hello", "The cat", [5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", max_model_len=512)


def _sample(llm: LLM, constraint: StructuredOutputsParams, max_tokens: int = 300, **kw) -> list:
    """One completion per (seed, prompt), all in one batch; returns the completions."""
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                       structured_outputs=constraint, **kw)
        for seed in SEEDS
    ]  # fmt: skip
    prompts = [PROMPTS[seed % len(PROMPTS)] for seed in SEEDS]
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_always_validate(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    for out in _sample(llm, StructuredOutputsParams(json=schema)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_schema_given_as_text_is_the_same_constraint(llm: LLM) -> None:
    schema = SCHEMAS["bounded_numbers"]
    as_dict = _sample(llm, StructuredOutputsParams(json=schema))
    as_text = _sample(llm, StructuredOutputsParams(json=json.dumps(schema)))
    assert [o.text for o in as_dict] == [o.text for o in as_text]


def test_regex_outputs_match_in_full(llm: LLM) -> None:
    pattern = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
    outputs = _sample(llm, StructuredOutputsParams(regex=pattern))
    for out in outputs:
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, out.text), out.text
    assert len({o.text for o in outputs}) > 1  # sampled, not one forced string


def test_choice_outputs_are_one_of_the_choices(llm: LLM) -> None:
    choices = ["yes", "no", "maybe 世界", 'say "hi"\n']
    outputs = _sample(llm, StructuredOutputsParams(choice=choices))
    assert all(o.text in choices and o.finish_reason == "stop" for o in outputs)


def test_ebnf_grammar_outputs_parse(llm: LLM) -> None:
    grammar = 'root ::= expr\nexpr ::= num | "(" expr op expr ")"\nop ::= "+" | "*"\nnum ::= [1-9]'
    for out in _sample(llm, StructuredOutputsParams(grammar=grammar), max_tokens=400):
        if out.finish_reason == "stop":  # an expression may nest past max_tokens
            assert re.fullmatch(r"[()1-9+*]+", out.text), out.text
            eval(out.text)  # balanced and well formed


def test_a_grammar_no_token_can_start_is_refused_before_anything_runs(llm: LLM) -> None:
    """A grammar whose rules only recurse passes the syntax check but allows no first token,
    not even the end: `generate` raises naming the field, and the good prompt of the same call
    is not left queued in the engine."""
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= root"))
    message = "structured_outputs.grammar matches no text this model's tokenizer can produce"
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["Hello", "The cat"], [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    assert not list(llm.engine.request_ids())
    assert llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_json_object_outputs_are_json_objects_or_cut_by_length(llm: LLM) -> None:
    outputs = _sample(llm, StructuredOutputsParams(json_object=True), max_tokens=120)
    for out in outputs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")


def test_constrained_and_free_requests_share_a_batch(llm: LLM) -> None:
    schema = SCHEMAS["nested_object"]
    constrained = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=300,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Hello"], free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["Hello", "Hello", "Hi"], [free, constrained, free], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone  # the mask touched only its own row
    jsonschema.validate(json.loads(outs[1].outputs[0].text), schema)


def test_overlap_scheduling_gives_the_same_constrained_tokens(llm: LLM, llama_dir: Path):
    constraint = StructuredOutputsParams(json=SCHEMAS["array_of_enums"])
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=constraint)
        for s in range(3)
    ]
    synchronous = LLM(str(llama_dir), device="cpu", max_model_len=512, overlap_scheduling=False)
    reference = synchronous.generate(["Hello"] * 3, params, use_tqdm=False)
    assert llm.config.runner.overlap_scheduling
    outputs = llm.generate(["Hello"] * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]


def test_masks_are_filled_off_the_scheduling_thread(llm: LLM, fill_threads: list[str]) -> None:
    # Without speculation the masks fill on a background thread while the engine schedules the
    # next step; the sampling that needs them is queued by the next launch (deferred).
    _sample(llm, StructuredOutputsParams(json=SCHEMAS["array_of_enums"]), max_tokens=20)
    assert fill_threads and all(name.startswith("grammar-masks") for name in fill_threads)


def test_a_dropped_engine_frees_its_runner_at_once(llama_dir: Path) -> None:
    # A constrained step's deferred sampling must not tie the runner into a reference cycle:
    # its GPU memory would wait for the garbage collector (the GPU tests ran out of memory).
    def run() -> weakref.ref:
        llm = LLM(str(llama_dir), device="cpu", max_model_len=256)
        # A short object: the grammars end the requests while a step is still in flight.
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        constraint = StructuredOutputsParams(json=schema)
        params = SamplingParams(
            temperature=1.0, seed=1, max_tokens=30, structured_outputs=constraint
        )
        llm.generate(["Hello"] * 3, params, use_tqdm=False)
        return weakref.ref(llm.engine.runner)

    gc.disable()
    try:
        runner = run()
        # The mask thread may still be filling the last step's masks (it holds the engine
        # until done); a reference cycle would hold the runner for good.
        deadline = time.monotonic() + 10
        while runner() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner() is None
    finally:
        gc.enable()


def test_preempted_constrained_requests_still_validate(llama_dir: Path) -> None:
    # 12 pages of 16 tokens for 8 sequences of ~50 prompt and ~25 output tokens: requests are
    # preempted and recomputed; each keeps its tokens, so its grammar state stays valid.
    llm = LLM(str(llama_dir), device="cpu", num_pages=12, max_model_len=190, page_size=16)
    schema = SCHEMAS["bounded_numbers"]
    prompt = list(range(10, 60))
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=100,
                       structured_outputs=StructuredOutputsParams(json=schema))
        for s in range(8)
    ]  # fmt: skip
    outputs = llm.generate([prompt] * 8, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for out in outputs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_min_tokens_cannot_push_a_finished_grammar_off_its_end(llm: LLM) -> None:
    constraint = StructuredOutputsParams(choice=["ok"])
    params = SamplingParams(
        temperature=1.0, max_tokens=20, min_tokens=10, structured_outputs=constraint
    )
    out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"


def test_ignore_eos_ends_when_the_grammar_is_complete(llm: LLM) -> None:
    constraint = StructuredOutputsParams(choice=["done"])
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, structured_outputs=constraint
    )
    out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "done" and out.finish_reason == "stop"


def test_a_compiling_grammar_does_not_hold_up_other_requests(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), device="cpu")
    engine = llm.engine
    # Big enough to compile for much longer than one step of the tiny model takes (~1 s on a
    # 2-core CPU), within the bound of optional properties (MAX_OPTIONAL_PROPERTY_PAIRS).
    props = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1}}}@[0-9]+x{i}"}
             for i in range(250)}  # fmt: skip
    slow = StructuredOutputsParams(json={"type": "object", "properties": props})
    engine.add_request("free", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("slow", [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=slow))
    steps_before_compiled = 0
    tokens: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        if engine.num_compiling:  # only "slow" can be compiling
            steps_before_compiled += 1
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
            if out.request_id == "free" and out.finished:
                assert engine.num_compiling == 1
    assert tokens["free"] == 4 and tokens["slow"] >= 1 and not engine.has_unfinished()
    assert steps_before_compiled >= 4
    # The second request with that schema finds it compiled: no wait.
    assert engine.grammar_compiler.submit(slow).done()


def test_a_model_without_tokenizer_refuses_constraints(tmp_path: Path, llama_dir: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    engine = LLM(str(tmp_path), device="cpu").engine
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
        engine.add_request("r", [1, 2, 3], params)
    assert not engine.has_unfinished() and engine.request_ids() == []


def test_abort_of_a_request_whose_grammar_is_compiling(llama_dir: Path) -> None:
    engine = LLM(str(llama_dir), device="cpu").engine
    props = {f"k{i}": {"type": "string", "pattern": f"[a-z]+{i}"} for i in range(200)}
    constraint = StructuredOutputsParams(json={"type": "object", "properties": props})
    engine.add_request("r", [1, 2, 3], SamplingParams(structured_outputs=constraint))
    out = engine.abort_request("r")
    assert out is not None and out.finish_reason is not None and out.finish_reason.value == "abort"
    assert not engine.has_unfinished()


def test_constrained_requests_beside_speculating_ones(llama_dir: Path) -> None:
    """With prompt lookup on, constrained requests (no drafts: one token a step, masked in the
    verify step) still validate, and unconstrained ones in the same batches still speculate
    and decode exactly as without speculation."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                       "prompt_lookup_min": 1, "prompt_lookup_max": 3})  # fmt: skip
    llm = LLM(str(llama_dir), device="cpu", max_model_len=512, speculative_config=spec)
    schema = SCHEMAS["nested_object"]
    constrained = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                       structured_outputs=StructuredOutputsParams(json=schema))
        for seed in SEEDS
    ]  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    repeats = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]  # prompt lookup finds drafts
    plain_prompts = [repeats, list(range(20, 40))]
    prompts = [PROMPTS[seed % len(PROMPTS)] for seed in SEEDS] + plain_prompts
    outputs = llm.generate(prompts, [*constrained, greedy, greedy], use_tqdm=False)
    for out in outputs[: len(SEEDS)]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.scheduler.spec_stats.num_drafts > 0
    reference = LLM(str(llama_dir), device="cpu", max_model_len=512)
    expected = reference.generate(plain_prompts, greedy, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs[len(SEEDS) :]]
    assert got == [o.outputs[0].token_ids for o in expected]


def test_grammars_cover_the_tokenizer_and_stop_tokens_not_the_embedding_padding() -> None:
    # xgrammar scans every id past the tokenizer on each accept and mask: they stay out.
    assert grammar_vocab_size(8192, 151936, [2]) == 8192
    assert grammar_vocab_size(151669, 151936, [151645]) == 151669
    assert grammar_vocab_size(8192, 151936, [151645]) == 151646  # a stop token past it
    assert grammar_vocab_size(160000, 151936, [2]) == 151936  # never past the model's


def test_the_mask_forbids_the_ids_past_the_grammar_vocabulary_on_grammar_rows_only() -> None:
    logits = torch.zeros(3, 70)
    bitmask = torch.full((3, 1), -1, dtype=torch.int32)  # 32 ids covered, all allowed
    bitmask[0, 0] = 0b100  # row 0's grammar allows token 2 only
    mask = GrammarMask(bitmask, frozenset({0, 2}))
    batch = SamplingBatch.from_rows(
        SamplingRows([SamplingParams(temperature=0)] * 3, [0] * 3), 70, torch.device("cpu"), mask
    )
    assert Sampler(torch.device("cpu"), 0)(logits, batch).token_ids.tolist() == [2, 0, 0]
    assert torch.isinf(logits[0, [0, 1, 3, 40, 69]]).all() and logits[0, 2] == 0
    assert torch.isinf(logits[2, 32:]).all() and not torch.isinf(logits[2, :32]).any()
    assert not torch.isinf(logits[1]).any()  # unconstrained: the whole vocabulary


def test_a_model_vocabulary_padded_past_its_tokenizer(tmp_path: Path, llama_dir: Path) -> None:
    """The grammars cover the tokenizer; the padding ids (a third of this vocabulary, not a
    multiple of 32) are forbidden by the sampler, so outputs still validate."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] += 301
    (tmp_path / "config.json").write_text(json.dumps(config))
    schema = SCHEMAS["nested_object"]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip
    for spec in (None, json.dumps(ngram)):  # verify steps mask every position of a row
        llm = LLM(str(tmp_path), device="cpu", max_model_len=512, load_format="dummy",
                  speculative_config=spec)  # fmt: skip
        for out in _sample(llm, StructuredOutputsParams(json=schema)):
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)
            assert max(out.token_ids) < config["vocab_size"] - 301
    assert llm.engine.scheduler.spec_stats.num_drafts > 0
