"""An MCP server written with the mcp SDK (``MCPServer``, the SDK's FastMCP) for the tests.

``python mcp_server.py`` serves over stdio; ``python mcp_server.py --http PORT`` serves streamable
HTTP at ``http://127.0.0.1:PORT/mcp``. Tools: ``multiply`` (the answer), ``sleepy`` (a server that
hangs past a deadline), ``die`` (a server that exits in the middle of a call), ``fail`` (a tool
that reports an error).
"""
import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("conveyor-test-tools")


@server.tool()
def multiply(a: int, b: int) -> str:
    """Multiply two integers exactly."""
    return str(a * b)


@server.tool()
async def sleepy(seconds: float) -> str:
    """Answer after the given number of seconds."""
    await asyncio.sleep(seconds)
    return "awake"


@server.tool()
def die() -> str:
    """End the server's process."""
    os._exit(3)


@server.tool()
def fail(reason: str) -> str:
    """Raise, so the server reports a tool error."""
    raise ValueError(reason)


if __name__ == "__main__":
    if "--http" in sys.argv:
        port = int(sys.argv[sys.argv.index("--http") + 1])
        server.run("streamable-http", host="127.0.0.1", port=port)
    else:
        server.run()
