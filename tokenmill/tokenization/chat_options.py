"""How a chat is rendered by the model's template: the options a chat request may set.

Its own module (no Jinja, no transformers) so that the API server's processes, which carry the
options to the tokenizer workers, import nothing heavy for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# apply_chat_template's own arguments and what it renders from: not for `template_kwargs`.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a chat is rendered (vLLM's chat request fields): end with the assistant's turn
    opened (`add_generation_prompt`), or leave the last (assistant) message open for the model
    to continue (`continue_final_message`); `template_kwargs`: more variables for the template
    (e.g. Qwen3's `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message cannot be combined with add_generation_prompt: set "
                "add_generation_prompt to false to continue the last message"
            )
        if not isinstance(self.template_kwargs, dict | None):
            raise ValueError(
                f"chat_template_kwargs must be an object, got {type(self.template_kwargs).__name__}"
            )
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(self.template_kwargs or ()))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}")


DEFAULT_CHAT_OPTIONS = ChatTemplateOptions()
