"""Chat template options (vLLM's chat fields): template variables, the generation prompt, and
continuing the last message; bad combinations refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.tokenization.chat_options import ChatTemplateOptions
from tokenmill.tokenization.tokenizer import apply_chat_template, load_tokenizer

THINKING_TEMPLATE = (
    "{{ 'think:' + ('on' if enable_thinking | default(true) else 'off') + ' ' }}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello wor"}]


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path):
    tok = load_tokenizer(str(llama_dir))
    tok.chat_template = THINKING_TEMPLATE
    return tok


def _text(tokenizer, options: ChatTemplateOptions, chat=CHAT) -> str:
    return tokenizer.decode(apply_chat_template(tokenizer, chat, options=options))


def test_template_variables_and_the_generation_prompt_reach_the_template(tokenizer) -> None:
    default = _text(tokenizer, ChatTemplateOptions())
    assert default.startswith("think:on") and default.endswith("assistant:")
    off = _text(tokenizer, ChatTemplateOptions(template_kwargs={"enable_thinking": False}))
    assert off.startswith("think:off") and off.endswith("assistant:")
    bare = _text(tokenizer, ChatTemplateOptions(add_generation_prompt=False))
    assert bare.endswith("Hello wor<|im_end|>")


def test_continue_final_message_leaves_the_last_message_open(tokenizer) -> None:
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    assert _text(tokenizer, options).endswith("assistant: Hello wor")
    with pytest.raises(ValueError, match="the last message to be the assistant's"):
        apply_chat_template(tokenizer, CHAT[:1], options=options)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"continue_final_message": True}, "continue_final_message cannot be combined"),
        ({"template_kwargs": {"tokenize": True}}, "chat_template_kwargs may not set ['tokenize']"),
        ({"template_kwargs": ["x"]}, "chat_template_kwargs must be an object"),
    ],
)
def test_bad_options_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ChatTemplateOptions(**kwargs)
    assert str(info.value).startswith(message.split(" ", 1)[0]) and message in str(info.value)


def test_llm_chat_takes_the_options(llama_dir: Path) -> None:
    """`LLM.chat` renders as `apply_chat_template` with the same options (vLLM's arguments)."""
    llm = LLM(str(llama_dir), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=3)
    out = llm.chat(CHAT, params, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]  # fmt: skip
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    assert out.prompt_token_ids == apply_chat_template(llm.tokenizer, CHAT, options=options)
    assert llm.tokenizer.decode(out.prompt_token_ids).endswith("Hello wor")
    with pytest.raises(ValueError, match="continue_final_message cannot be combined"):
        llm.chat(CHAT, params, continue_final_message=True)


@pytest.mark.parametrize(
    ("template", "kwargs"),
    [
        ("{{ 10 // depth }}", {"depth": 0}),  # ZeroDivisionError
        ("{% for i in range(turns) %}.{% endfor %}", {"turns": 10**9}),  # the sandbox's limit
        ("{{ 1.5 * scale }}", {"scale": 10**400}),  # OverflowError: a JSON integer as a float
    ],
)
def test_template_variables_it_cannot_evaluate_are_a_value_error(
    tokenizer, template: str, kwargs: dict
) -> None:
    """What the template raises on a client's variables is the client's to fix (a 400), of
    whatever type: not a 500 from the tokenizer worker or /tokenize."""
    original = tokenizer.chat_template
    tokenizer.chat_template = template + "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        options = ChatTemplateOptions(template_kwargs=kwargs)
        with pytest.raises(ValueError, match="messages can not be rendered by the chat template"):
            apply_chat_template(tokenizer, CHAT, options=options)
    finally:
        tokenizer.chat_template = original
