"""Running the tool calls of one model turn: parse, check, call under deadline and breaker.

Contract: ``run_tool_calls(session, action)`` returns None when the turn
holds no tool call (the environment's ``step`` then answers it), else
``(StepResult(observation), tool names, failure class or "")`` where the
observation is every call's result or error, in order (``env.parsers``
formats them). Malformed calls, unknown tools, bad arguments, a tool's
``ToolError``, a crash, a timeout and a quarantined tool are counted on the
pool by class and answered as error observations; nothing raises.

It knows nothing of tokens or engines.
"""
from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

from conveyor.env.api import EnvFailure, StepResult, ToolError
from conveyor.env.parsers import check_call, format_error, format_tool_result, parse_tool_calls

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.env.pool import EnvSession


async def run_tool_calls(session: "EnvSession", action: str) -> tuple[StepResult, tuple[str, ...], str] | None:
    pool, tools = session.pool, session.tools
    parsed = parse_tool_calls(action, pool.tool_format, tools)
    if not parsed.calls and not parsed.errors:
        return None
    parts: list[str] = []
    names: list[str] = []
    failure = ""
    for err in parsed.errors:
        pool.count(err.kind)
        parts.append(format_error(err.message))
        failure = failure or err.kind
    by_name = {t.name: t for t in tools}
    for call in parsed.calls:
        names.append(call.name)
        pool.count("tool_calls")
        text, kind = await _one_call(session, call, by_name)
        parts.append(text)
        if kind:
            pool.count(kind)
            failure = failure or kind
    return StepResult("\n".join(parts)), tuple(names), failure


async def _one_call(session: "EnvSession", call, by_name) -> tuple[str, str]:
    """(observation text, failure class or "") of one call."""
    pool = session.pool
    problem = check_call(call, list(by_name.values()))
    if problem is not None:
        return format_error(str(problem)), problem.kind
    tool = by_name[call.name]
    key = f"tool:{tool.name}"
    if not pool.breaker.allow(key):
        return format_error(f"tool {tool.name} is unavailable (quarantined after repeated failures)"), "quarantined"
    timeout, what = tool.timeout_s or pool.limits.tool_timeout_s, f"tool {tool.name}"
    if inspect.iscoroutinefunction(tool.fn):
        async def run():
            return await tool.fn(**call.arguments)
    else:  # a plain function runs in the pool's threads, so a slow one does not stop the loop
        run = functools.partial(tool.fn, **call.arguments)
    try:
        out = await pool.call(run, timeout=timeout, what=what)
    except ToolError as e:
        # The tool answered with a failure the model should read (bad input, a sandbox violation,
        # the model's code running out of time): the tool itself works; its breaker counts only
        # the tool's own failures (a crash, no answer within the deadline).
        pool.breaker.record(key, True)
        return format_error(f"{tool.name}: {e}"), e.kind
    except EnvFailure as e:
        pool.breaker.record(key, False)
        return format_error(str(e)), e.kind
    if not isinstance(out, str):
        pool.breaker.record(key, False)
        return format_error(f"tool {tool.name} returned {type(out).__name__}, not text"), "bad_return"
    pool.breaker.record(key, True)
    return format_tool_result(tool.name, out), ""
