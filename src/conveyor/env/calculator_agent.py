"""An agent written with the plain `openai` client, trained by ``recipes/openai_agent.yaml``.

Contract: ``solve(base_url, api_key, task)`` (``env.kwargs.agent:
conveyor.env.calculator_agent:solve``) answers ``task.prompt`` (e.g.
``"123*456="``) with up to ``MAX_CALLS`` chat-completion calls to the model
named ``MODEL`` at ``base_url``, offering one tool, ``calculator``, which it
runs itself (``conveyor.env.tools.calculator.calculate``) and answers with a
``tool`` message. The first reply without a tool call is the answer; the
return is 1.0 when it equals ``task.answer`` after stripping spaces, else
0.0 (also when the calls run out). It is an ordinary agent: nothing in it
knows it is being trained.

It knows nothing of conveyor's engines, tokens or trainer; only the OpenAI API.
"""
from __future__ import annotations

import json
from typing import Any

from conveyor.env.tools.calculator import calculate
from conveyor.types import Task

MODEL = "policy"  # env.endpoint.model
MAX_CALLS = 3     # env.max_turns of the recipe
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Exact arithmetic: + - * / // % ** and parentheses",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def run_tool(arguments: str) -> str:
    try:
        return calculate(json.loads(arguments)["expression"])
    except Exception as e:  # noqa: BLE001 - the model reads what went wrong, as with any tool
        return f"error: {e}"


_clients: dict[str, Any] = {}


def client_for(base_url: str, api_key: str) -> Any:
    """One client per endpoint, copied with each episode's key: a new client builds an SSL context
    (tens of ms), which every episode would pay; the copies share one connection pool."""
    from openai import AsyncOpenAI
    shared = _clients.get(base_url)
    if shared is None:
        shared = _clients[base_url] = AsyncOpenAI(base_url=base_url, api_key="unset", max_retries=0, timeout=600)
    return shared.with_options(api_key=api_key)


async def solve(base_url: str, api_key: str, task: Task) -> float:
    client = client_for(base_url, api_key)
    messages: list[dict] = [{"role": "user", "content": task.prompt}]
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float((message.content or "").strip() == (task.answer or "").strip())
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.arguments)})
    return 0.0
