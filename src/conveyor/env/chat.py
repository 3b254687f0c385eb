"""How tools reach the model: the prompt text, rendered through the tokenizer's chat template.

Contract: ``render_prompt(tokenizer, messages, tools) -> str`` is the text the model reads
before its turn (generation prompt included): the template's own rendering of the tools where
it renders them, else ``tools_system_prompt(tools)`` (the Hermes description) in the system
message. The input ``messages`` are never modified.

This module knows no parser and no engine: it does not check that the model will answer in
the format its template describes (pick the parser format to match: ``hermes`` for the
fallback here).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from conveyor.env.api import Tool

_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{schemas}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_system_prompt(tools: Sequence[Tool]) -> str:
    """The Hermes-style description of ``tools`` (what Qwen2.5's template writes)."""
    schemas = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in tools)
    return _TOOLS_PROMPT.format(schemas=schemas)


def render_prompt(tokenizer: Any, messages: list[dict], tools: Sequence[Tool]) -> str:
    """The prompt for the model's next turn, with ``tools`` described.

    - With a chat template that renders ``tools`` (Qwen2.5/3, Llama 3.1+, Hermes, ...): the
      template's own rendering, ``apply_chat_template(messages, tools=[t.schema() ...],
      add_generation_prompt=True, tokenize=False)``.
    - With a chat template that ignores ``tools`` (rendering with and without them gives the
      same text) or fails on them: ``tools_system_prompt(tools)`` (the Hermes description: the
      schemas as JSON lines inside ``<tools></tools>`` and the ``<tool_call>`` format) goes into
      the system message (merged after an existing one, or prepended), rendered by the template.
    - Without a chat template: the same system text, then each message as ``<role>: <content>``
      on its own line, then ``assistant:``.
    - No tools: the template's rendering of the messages (or the plain join), nothing added.
    The input ``messages`` are never modified.
    """
    messages = [dict(m) for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        return _plain_join(_with_tools_system(messages, tools) if tools else messages)
    plain = _apply(tokenizer, messages)
    if not tools:
        return plain
    from jinja2 import TemplateError
    try:
        rendered = _apply(tokenizer, messages, tools=[t.schema() for t in tools])
    except (TemplateError, TypeError, ValueError):
        rendered = plain  # a template that fails on tools cannot show them either
    if rendered != plain:
        return rendered
    return _apply(tokenizer, _with_tools_system(messages, tools))


def _apply(tokenizer: Any, messages: list[dict], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    if not isinstance(text, str):
        raise TypeError(f"{type(tokenizer).__name__}.apply_chat_template(tokenize=False) returned "
                        f"{type(text).__name__}, not str; use a Hugging Face tokenizer")
    return text


def _with_tools_system(messages: list[dict], tools: Sequence[Tool]) -> list[dict]:
    """``messages`` with the tools' description in the system message (merged or prepended)."""
    description = tools_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        existing = str(first.get("content") or "").rstrip()
        first["content"] = f"{existing}\n\n{description}" if existing else description
        return [first] + messages[1:]
    return [{"role": "system", "content": description}] + messages


def _plain_join(messages: list[dict]) -> str:
    lines = [f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in messages]
    return "\n".join(lines + ["assistant:"])
