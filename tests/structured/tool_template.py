"""A Hermes / Qwen2.5-style chat template (tools, tool calls, tool results) for test checkpoints."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

HERMES_TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Function signatures within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

Return each call as {"name": <name>, "arguments": <args>} in <tool_call></tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def use_tools_template(checkpoint: Path) -> Path:
    """Give the checkpoint's tokenizer the Hermes tools template; returns the checkpoint."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = HERMES_TOOLS_TEMPLATE
    tokenizer.save_pretrained(checkpoint)
    return checkpoint
