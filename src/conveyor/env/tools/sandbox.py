"""The bubblewrap sandbox (``conveyor.sandbox``) offered to the model as the ``python`` tool.

Contract: ``python_tool(sandbox)`` is a ``Tool`` taking ``{"code": str}``; the observation is
stdout, then stderr and a nonzero exit code if any; a violation raises ``ToolError`` (kind
``timeout`` for the deadline, else ``sandbox_violation``). What the sandbox guarantees, and
what it does not: ``conveyor/sandbox.py``.
"""
from __future__ import annotations

from conveyor.env.api import Tool, ToolError
from conveyor.sandbox import PythonSandbox, SandboxLimits, SandboxResult, SandboxUnavailable

__all__ = ["PythonSandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "python_tool"]


def python_tool(sandbox: PythonSandbox, name: str = "python") -> Tool:
    """The sandbox as a ``Tool`` taking ``{"code": str}``."""
    lim = sandbox.limits

    def run_python(code: str) -> str:
        if not isinstance(code, str):
            raise ToolError(f"`code` must be a string, got {type(code).__name__}", kind="bad_arguments")
        r = sandbox.run(code)
        text = r.stdout
        for extra in ([f"[stderr]\n{r.stderr}"] if r.stderr else []) + ([f"[exit code {r.exit_code}]"]
                                                                        if r.exit_code else []):
            text += ("" if not text or text.endswith("\n") else "\n") + extra
        if r.violation == "timeout":
            raise ToolError(f"the program was stopped at the {lim.wall_s:g} s deadline\n{text}", kind="timeout")
        if r.violation:
            raise ToolError(f"sandbox limit exceeded ({r.violation})\n{text}", kind="sandbox_violation")
        return text

    desc = (f"Run a Python 3 program and read its output (stdout, stderr). No network; only /tmp is "
            f"writable; limits: {lim.wall_s:g} s, {lim.memory_mb} MB, {lim.output_bytes} bytes of output. "
            "Print what you want to see.")
    return Tool(name, desc, {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                run_python, timeout_s=lim.wall_s + 5)  # past the sandbox's own deadline, which ends it cleanly
