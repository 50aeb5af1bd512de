"""Structured outputs with speculative decoding: drafts are checked against the grammar (masks
past each draft, the matcher rolled back), so constrained requests speculate and still always
parse; greedy tokens are those of the same constraint without speculation."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.structured.matcher import BitmaskFiller, RequestGrammar
from tokenmill.tokenization.tokenizer import load_tokenizer

# Repetitive output (a list of like objects): prompt lookup finds drafts in what came before.
SCHEMA = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 3,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                "required": ["id", "ok"],
            },
        }
    },
    "required": ["rows"],
}
CONSTRAINT = StructuredOutputsParams(json=SCHEMA)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}  # fmt: skip
PROMPTS = ["Hello", "The cat", [5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def speculative(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), device="cpu", max_model_len=512, speculative_config=NGRAM)


def test_masks_fill_on_the_scheduling_thread(speculative: LLM, fill_threads: list[str]) -> None:
    # Scheduling checks drafts against the grammars, so their masks are not filled beside it.
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=CONSTRAINT)
    speculative.generate(["Hello"], params, use_tqdm=False)
    assert fill_threads and set(fill_threads) == {threading.current_thread().name}


def test_sampled_constrained_outputs_validate_and_drafts_are_accepted(speculative: LLM) -> None:
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=300, structured_outputs=CONSTRAINT)
        for seed in range(4)
    ]
    prompts = [PROMPTS[seed % len(PROMPTS)] for seed in range(4)]
    stats = speculative.engine.scheduler.spec_stats
    before = stats.num_accepted_tokens
    outputs = speculative.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert stats.num_accepted_tokens > before  # constrained requests did speculate


def test_sampled_constrained_outputs_with_logprobs_validate(speculative: LLM) -> None:
    # A sampled verify step with logprobs must not turn its rejected positions (placeholders)
    # into token 0: the grammar would reject it and the request end in "error".
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=300, logprobs=1,
                       structured_outputs=CONSTRAINT)
        for seed in range(4)
    ]  # fmt: skip
    prompts = [PROMPTS[seed % len(PROMPTS)] for seed in range(4)]
    for out in speculative.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert len(completion.logprobs) == len(completion.token_ids)


def test_a_drafted_stop_token_ends_the_grammar_under_ignore_eos(speculative: LLM) -> None:
    # The prompt holds the output and then the stop token: prompt lookup drafts the stop token
    # once the grammar is complete; the position after it must not add a token past the end.
    constraint = StructuredOutputsParams(choice=["done"])
    greedy = SamplingParams(temperature=0, max_tokens=20, structured_outputs=constraint)
    done = speculative.generate(["Hello"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    eos = speculative.engine.config.model.eos_token_ids[0]
    assert done[-1] == eos
    prompt = [5, 6, *done, 7, 8, 9, *done, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            structured_outputs=constraint)  # fmt: skip
    out = speculative.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "done" and out.finish_reason == "stop"


def test_greedy_constrained_tokens_do_not_depend_on_speculation(
    speculative: LLM, llama_dir: Path
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=200, structured_outputs=CONSTRAINT)
    plain = LLM(str(llama_dir), device="cpu", max_model_len=512)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in speculative.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == expected


def _draft_model(draft: Path) -> dict[str, object]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "adaptive": False}  # fmt: skip


def test_the_draft_model_drafts_for_constrained_requests(llama_dir: Path, draft_dir: Path) -> None:
    """Its drafts, made on the device, come to the host before the masks past them are
    filled: greedy tokens are those without speculation, sampled outputs parse."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=512,
              speculative_config=_draft_model(draft_dir))  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=200, structured_outputs=CONSTRAINT)
    plain = LLM(str(llama_dir), device="cpu", max_model_len=512)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == expected
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    sampled = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=300, logprobs=1,
                       structured_outputs=CONSTRAINT)
        for seed in range(2)
    ]  # fmt: skip
    for out in llm.generate(PROMPTS[:2], sampled, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert len(completion.logprobs) == len(completion.token_ids)


def test_draft_model_drafts_the_grammar_allows_are_accepted(llama_dir: Path) -> None:
    """Choices holding the start of the target's own free greedy text (up to its first broken
    character): the target as its own draft drafts what the grammar allows, and verification
    under the masks past the drafts accepts them."""
    plain = LLM(str(llama_dir), device="cpu", max_model_len=512)
    tokenizer = plain.get_tokenizer()
    assert tokenizer is not None
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The cat", "def f", "Hello"]
    params = []
    for out in plain.generate(prompts, free, use_tqdm=False):
        ids = out.outputs[0].token_ids
        clean = max(n for n in range(len(ids) + 1) if "\ufffd" not in tokenizer.decode(ids[:n]))
        assert clean >= 3
        choice = StructuredOutputsParams(choice=[tokenizer.decode(ids[:clean])])
        params.append(SamplingParams(temperature=0, max_tokens=40, structured_outputs=choice))
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(llama_dir), device="cpu", max_model_len=512,
              speculative_config=_draft_model(llama_dir))  # fmt: skip
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens >= 5, stats


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_stop_token_the_draft_model_drafts_ends_the_grammar_under_ignore_eos(
    temperature: float, llama_dir: Path
) -> None:
    """The draft model's drafts are not cut short of a stop token (prompt lookup's are,
    `valid_prefix`): one that ends the grammar is accepted, and the positions after it, which
    no grammar constrains, emit nothing; under ignore_eos a token there ended the request in
    "error" (its grammar refused it). A logit bias makes the draft model draft the stop token
    at every position."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=512,
              speculative_config=_draft_model(llama_dir))  # fmt: skip
    eos = llm.engine.config.model.eos_token_ids[0]
    done = StructuredOutputsParams(choice=["done"])
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=20, ignore_eos=True,
                            logit_bias={eos: 30.0}, structured_outputs=done)  # fmt: skip
    out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "done" and out.finish_reason == "stop"
    assert out.token_ids[-1] == eos and out.token_ids.count(eos) == 1
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("at", [2, 3])
def test_a_constrained_requests_bad_words_hold_past_the_draft_models_drafts(
    at: int, llama_dir: Path
) -> None:
    """A choice between the target's own free text and a turn away from it at token `at`,
    and a bad word of the two free tokens there: inside the first verify window the target as
    its own draft drafts the free text, and the mask past its drafts must ban the word's
    second token (its bans completed from the drafts), as plain decoding does (which then
    spells a choice in other tokens)."""
    plain = LLM(str(llama_dir), device="cpu", max_model_len=512)
    tokenizer = plain.get_tokenizer()
    assert tokenizer is not None
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = plain.generate(["The cat"], free, use_tqdm=False)[0].outputs[0].token_ids
    clean = max(n for n in range(len(ids) + 1) if "\ufffd" not in tokenizer.decode(ids[:n]))
    assert clean > at + 1
    choices = [tokenizer.decode(ids[:clean]), tokenizer.decode(ids[:at]) + "zz"]
    constraint = StructuredOutputsParams(choice=choices)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint,
                            bad_words_token_ids=[ids[at - 1 : at + 1]])  # fmt: skip
    expected = plain.generate(["The cat"], params, use_tqdm=False)[0].outputs[0]
    assert expected.token_ids[at] != ids[at]  # the word is banned
    llm = LLM(str(llama_dir), device="cpu", max_model_len=512,
              speculative_config=_draft_model(llama_dir))  # fmt: skip
    got = llm.generate(["The cat"], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_masks_past_drafts_are_the_grammars_after_them(llama_dir: Path) -> None:
    tokenizer = load_tokenizer(str(llama_dir))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    grammar = RequestGrammar(compiled)
    drafts = tokenizer.encode('{"rows": [', add_special_tokens=False)
    bad = tokenizer.encode("x", add_special_tokens=False)[0]
    filler = BitmaskFiller(len(tokenizer), pin=False)
    ahead = [tuple(drafts[:j]) for j in range(len(drafts) + 1)] + [
        (*drafts, bad),
        (*drafts, bad, 5),
    ]
    masks = filler.fill([grammar] * len(ahead), ahead=ahead).clone()  # type: ignore[union-attr]
    for j in range(len(drafts) + 1):
        fresh = RequestGrammar(compiled)
        assert all(fresh.accept_token(t) for t in drafts[:j])
        expected = filler.fill([fresh])
        assert torch.equal(masks[j], expected[0]), j  # type: ignore[index]
    # After a draft the grammar refuses, the position cannot be reached: no constraint.
    assert (masks[-2] == -1).all() and (masks[-1] == -1).all()
    # The grammar is where it was: nothing accepted yet.
    assert grammar.valid_prefix(drafts) == len(drafts) and grammar.valid_prefix([bad]) == 0


def test_the_grammar_knows_a_stop_token_ended_it_and_a_rollback_reopened_it(
    llama_dir: Path,
) -> None:
    tokenizer = load_tokenizer(str(llama_dir))
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    )
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "ok"')
    grammar = RequestGrammar(compiled)
    ok = tokenizer.encode("ok", add_special_tokens=False)
    assert all(grammar.accept_token(t) for t in ok) and not grammar.is_terminated
    # A drafted stop token is not offered: what follows it would be sampled unconstrained.
    assert grammar.valid_prefix([tokenizer.eos_token_id, 5]) == 0 and not grammar.is_terminated
    assert grammar.accept_token(tokenizer.eos_token_id) and grammar.is_terminated
    assert grammar.matcher.is_terminated()
    grammar.rollback(1)
    assert not grammar.is_terminated and not grammar.matcher.is_terminated()


def test_accepting_a_batch_is_accepting_each_row(llama_dir: Path) -> None:
    tokenizer = load_tokenizer(str(llama_dir))
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos]
    )
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "ok"')
    ok = tokenizer.encode("ok", add_special_tokens=False)
    # Rows: one about to stop, one refusing a token, one mid-way, one already ended.
    prefixes, tokens = [ok, ok, ok[:-1], [*ok, eos]], [eos, ok[0], ok[-1], eos]
    grammars = [RequestGrammar(compiled) for _ in prefixes]
    singles = [RequestGrammar(compiled) for _ in prefixes]
    for pair in zip(grammars, singles, prefixes, strict=True):
        assert all(g.accept_token(t) for g in pair[:2] for t in pair[2])
    accepted = RequestGrammar.accept_batch(grammars, tokens)
    assert accepted == [g.accept_token(t) for g, t in zip(singles, tokens, strict=True)]
    assert accepted[:2] == [True, False]
    assert [g.is_terminated for g in grammars] == [g.is_terminated for g in singles]
    assert grammars[0].is_terminated and not grammars[2].is_terminated


def test_a_reused_mask_buffer_frees_rows_that_lost_their_grammar(llama_dir: Path) -> None:
    """Filled rows are written whole, the others set to all-ones: a row constrained in an
    earlier step of the same buffer (they alternate) is free again."""
    tokenizer = load_tokenizer(str(llama_dir))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    grammar = RequestGrammar(compiled)
    filler = BitmaskFiller(len(tokenizer), pin=False)
    first = filler.fill([grammar, None])
    assert first is not None and not (first[0] == -1).all() and (first[1] == -1).all()
    filler.fill([grammar, None])
    third = filler.fill([None, grammar])
    assert third is not None and third.data_ptr() == first.data_ptr()
    assert (third[0] == -1).all() and not (third[1] == -1).all()
