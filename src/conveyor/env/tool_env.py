"""A tool-use environment: the model may call tools, and its turn without a call is the answer.

Contract: ``ToolEnv(tools=("calculator",), answer="exact", ...)`` declares
the named built-in tools (``calculator``; ``python``, run in the sandbox;
``search`` over ``search_folder``) and the tools of the MCP servers in
``mcp_servers`` (``env.tools.mcp``; their connections are released by
``close()``); the pool runs the calls (``env.pool``).
``reset(task)`` shows ``task.prompt``; ``step(action)`` gets the turn that
holds no tool call, the final answer, and ends the episode with reward 1.0
when it matches ``task.answer`` (``answer="exact"``: equal after stripping
spaces; ``"math"``: math-verify equivalence) and 0.0 otherwise.

It knows nothing of tokens, parsers or engines.
"""
from __future__ import annotations

from typing import Any, Sequence

from conveyor.env.api import StepResult, Tool
from conveyor.types import Task

TOOL_NAMES = ("calculator", "python", "search")


class ToolEnv:
    def __init__(self, tools: Sequence[str] = ("calculator",), answer: str = "exact",
                 search_folder: str | None = None, sandbox: dict[str, Any] | None = None,
                 unsafe_python: bool = False, mcp_servers: Sequence[dict] = ()):
        unknown = [t for t in tools if t not in TOOL_NAMES]
        if unknown:
            raise ValueError(f"env.kwargs.tools: unknown tool(s) {unknown}; choose from {list(TOOL_NAMES)}")
        if answer not in ("exact", "math"):
            raise ValueError(f"env.kwargs.answer={answer!r}: choose 'exact' or 'math'")
        self.answer = answer
        self.tools: tuple[Tool, ...] = tuple(_make_tool(t, search_folder, sandbox, unsafe_python) for t in tools)
        self._release_mcp = None
        if mcp_servers:
            from conveyor.env.tools.mcp import mcp_tools
            remote, self._release_mcp = mcp_tools(mcp_servers)
            clash = sorted({t.name for t in remote} & {t.name for t in self.tools})
            if clash:
                self._release_mcp()
                raise ValueError(f"env.kwargs.mcp_servers offer {clash}, which env.kwargs.tools also names; "
                                 "give the server a 'prefix'")
            self.tools += remote
        self.task: Task | None = None

    def close(self) -> None:
        if self._release_mcp is not None:
            self._release_mcp()
            self._release_mcp = None

    def reset(self, task: Task) -> str:
        self.task = task
        return task.prompt

    def step(self, action: str) -> StepResult:
        gold = (self.task.answer or "") if self.task else ""
        if self.answer == "math":
            from conveyor.verifiers import math_verdict
            ok = math_verdict(action, self.task.answer, self.task.id)["reward"] >= 1.0
        else:
            ok = action.strip() == gold.strip()
        return StepResult("", 1.0 if ok else 0.0, True, {"correct": ok})


def _make_tool(name: str, folder: str | None, sandbox: dict[str, Any] | None, unsafe: bool) -> Tool:
    if name == "calculator":
        from conveyor.env.tools.calculator import calculator_tool
        return calculator_tool()
    if name == "search":
        if not folder:
            raise ValueError("env.kwargs.tools has 'search': set env.kwargs.search_folder to a folder of .txt/.md files")
        from conveyor.env.tools.search import search_tool
        return search_tool(folder)
    from conveyor.env.tools.sandbox import PythonSandbox, SandboxLimits, python_tool
    return python_tool(PythonSandbox(SandboxLimits(**(sandbox or {})), unsafe=unsafe))
