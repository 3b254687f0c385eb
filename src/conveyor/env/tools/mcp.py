"""Tools of MCP servers (Model Context Protocol) as tools of the environment pool.

- ``McpServer.parse(spec, i)`` reads one entry of ``env.kwargs.mcp_servers`` (stdio or
  streamable HTTP); a bad entry is one ``ValueError`` naming it and the fix.
- ``mcp_tools(servers) -> (tools, release)``: one ``conveyor.env.api.Tool`` per tool the
  servers list; one connection per server is shared by every environment instance that names it.
- A call runs under its deadline; a server that died fails the call and is started again by the
  next; a result marked ``isError`` is a ``ToolError`` the model reads.

It knows nothing of tokens, parsers or engines: a tool call in, text out.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from conveyor.env.api import Tool, ToolError

log = logging.getLogger(__name__)
_KEYS = {"name", "command", "args", "env", "cwd", "url", "headers", "prefix", "timeout_s", "start_timeout_s"}


@dataclass(frozen=True)
class McpServer:
    """Where one MCP server is (stdio ``command`` or streamable-HTTP ``url``) and its call deadlines.

    ``McpServer.parse(spec, i)`` reads one entry of ``env.kwargs.mcp_servers``:
    ``{command: prog, args: [...], env: {...}, cwd: dir}`` (stdio: the server
    is started as a process) or ``{url: http://host:port/mcp, headers: {...}}``
    (streamable HTTP), plus optional ``name``, ``prefix`` (put before every
    tool name, to keep two servers' tools apart), ``timeout_s`` (deadline of
    one call; default the pool's ``env.tool_timeout_s``) and
    ``start_timeout_s`` (deadline of connecting and listing, default 30).
    A bad entry is one ``ValueError`` naming it and the fix.
    """
    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    prefix: str = ""
    timeout_s: float | None = None
    start_timeout_s: float = 30.0

    @classmethod
    def parse(cls, spec: Any, i: int = 0) -> "McpServer":
        where = f"env.kwargs.mcp_servers[{i}]"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where} is a {type(spec).__name__}; give {{command: prog, args: [...]}} or "
                             "{url: http://host:port/mcp}")
        unknown = sorted(set(spec) - _KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
        if ("command" in spec) == ("url" in spec):
            raise ValueError(f"{where} needs exactly one of command (a stdio server) or url (streamable HTTP)")
        args = spec.get("args") or []
        if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}.args must be a list of strings")
        for key in ("timeout_s", "start_timeout_s"):
            if key in spec and (not isinstance(spec[key], (int, float)) or spec[key] <= 0):
                raise ValueError(f"{where}.{key}={spec[key]!r}: give a positive number of seconds")
        name = str(spec.get("name") or spec.get("command") or spec.get("url"))
        return cls(name=name, command=spec.get("command"), args=tuple(args),
                   env=tuple(sorted((str(k), str(v)) for k, v in (spec.get("env") or {}).items())),
                   cwd=spec.get("cwd"), url=spec.get("url"),
                   headers=tuple(sorted((str(k), str(v)) for k, v in (spec.get("headers") or {}).items())),
                   prefix=str(spec.get("prefix") or ""), timeout_s=spec.get("timeout_s"),
                   start_timeout_s=float(spec.get("start_timeout_s", 30.0)))


@dataclass
class _Held:
    client: Any
    stop: asyncio.Event


class McpConnection:
    """One server, connected lazily from an event loop of its own; ``call`` is awaitable from any loop."""

    def __init__(self, server: McpServer):
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{server.name}"[:15], daemon=True)
        self._thread.start()
        self._held: _Held | None = None
        self._connecting: asyncio.Future | None = None
        self.listed: list[Any] = []

    # ----- on the connection's own loop ------------------------------------------------
    def _transport(self) -> Any:
        from mcp import StdioServerParameters
        s = self.server
        if s.command is not None:
            return StdioServerParameters(command=s.command, args=list(s.args), env=dict(s.env) or None, cwd=s.cwd)
        if not s.headers:
            return s.url
        import httpx2
        from mcp.client.streamable_http import streamable_http_client
        return streamable_http_client(s.url, http_client=httpx2.AsyncClient(headers=dict(s.headers)))

    async def _hold(self, ready: asyncio.Future) -> None:
        """Keep the session open until told to stop (or until the server goes away)."""
        from mcp import Client
        stop = asyncio.Event()
        try:
            async with Client(self._transport(), read_timeout_seconds=self.server.start_timeout_s) as client:
                self._held = _Held(client, stop)
                ready.set_result(client)
                await stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits for the connection
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        finally:
            self._held = None

    async def _client(self) -> Any:
        if self._held is not None:
            return self._held.client
        if self._connecting is None or self._connecting.done():
            ready = self._loop.create_future()
            self._connecting = ready
            self._loop.create_task(self._hold(ready))
        return await asyncio.shield(self._connecting)

    async def _list(self) -> list[Any]:
        client = await self._client()
        tools, cursor = [], None
        for _ in range(100):  # a paginator that never ends must not hang the start
            page = await client.list_tools(cursor=cursor)
            tools += list(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    async def _call(self, name: str, arguments: Mapping[str, Any], timeout: float) -> Any:
        client = await self._client()
        try:
            return await client.call_tool(name, dict(arguments), read_timeout_seconds=timeout)
        except Exception:
            self._drop()  # the next call starts the server again
            raise

    def _drop(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.stop.set()

    # ----- from other threads ------------------------------------------------------------
    def list_tools(self) -> list[Any]:
        """The server's tools (connecting first), within ``start_timeout_s``."""
        fut = asyncio.run_coroutine_threadsafe(self._list(), self._loop)
        try:
            self.listed = fut.result(timeout=self.server.start_timeout_s)
        except TimeoutError:
            fut.cancel()
            raise RuntimeError(f"MCP server {self.server.name!r} did not list its tools within "
                               f"{self.server.start_timeout_s:g}s (start_timeout_s)") from None
        except Exception as e:
            raise RuntimeError(f"MCP server {self.server.name!r} cannot be reached: {type(e).__name__}: "
                               f"{_first_line(e)}") from None
        return self.listed

    async def call(self, name: str, arguments: Mapping[str, Any], timeout: float) -> str:
        """The tool's result as text; awaited on the caller's loop (cancelling it cancels the call)."""
        result = await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._call(name, arguments, timeout), self._loop))
        text = _result_text(result)
        if getattr(result, "is_error", False):
            raise ToolError(text or f"{name} failed", kind="crash")
        return text

    def close(self, timeout_s: float = 10.0) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._drop)

        async def settle():  # let the session close (and the stdio server stop) before the loop does
            for _ in range(int(timeout_s * 20)):
                if self._held is None and not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                    return
                await asyncio.sleep(0.05)
        try:
            asyncio.run_coroutine_threadsafe(settle(), self._loop).result(timeout=timeout_s + 1)
        except Exception as e:  # noqa: BLE001 - closing is best effort
            log.info("MCP server %s did not close cleanly: %s", self.server.name, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout_s)


_lock = threading.Lock()
_shared: dict[McpServer, tuple[McpConnection, int]] = {}


def _acquire(server: McpServer) -> McpConnection:
    with _lock:
        conn, n = _shared.get(server, (None, 0))
        if conn is None:
            conn = McpConnection(server)
        _shared[server] = (conn, n + 1)
        return conn


def _release(server: McpServer) -> None:
    with _lock:
        conn, n = _shared.get(server, (None, 0))
        if conn is None:
            return
        if n > 1:
            _shared[server] = (conn, n - 1)
            return
        del _shared[server]
    conn.close()


def mcp_tools(servers: Sequence[Any]) -> tuple[tuple[Tool, ...], Callable[[], None]]:
    """Tools of the servers in ``env.kwargs.mcp_servers`` and the function that releases them.

    ``mcp_tools(servers) -> (tools, release)``: one ``conveyor.env.api.Tool``
    per tool the servers list, with the server's JSON schema as
    ``parameters``; calling it calls the server. ``release()`` gives the
    connections back (an environment calls it from ``close()``).
    - One connection per server is shared by every environment instance that
    names it (reference-counted; the last release closes it and, for stdio,
    stops the process). Each connection lives on an event loop in a thread of
    its own, because the SDK's sessions must be entered and left in one task.
    A call runs under its deadline (the pool's ``tool_timeout_s`` or
    ``timeout_s``; a hung server is cancelled there and counted as a
    ``timeout`` by the pool, its breaker quarantining a server that keeps
    failing); a server that died fails the call (a counted ``crash``) and is
    started again by the next call. A tool result marked ``isError`` is a
    ``ToolError`` the model reads (the server works; its input or tool failed).
    """
    parsed = [s if isinstance(s, McpServer) else McpServer.parse(s, i) for i, s in enumerate(servers)]
    held: list[McpServer] = []

    def release() -> None:
        while held:
            _release(held.pop())
    tools: list[Tool] = []
    try:
        for server in parsed:
            conn = _acquire(server)
            held.append(server)
            tools += [_tool(conn, t) for t in conn.list_tools()]
    except BaseException:
        release()
        raise
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        release()
        raise ValueError(f"env.kwargs.mcp_servers: tool name(s) {dup} are offered twice; give the servers a "
                         "'prefix' to keep them apart")
    return tuple(tools), release


def _tool(conn: McpConnection, listed: Any) -> Tool:
    server, remote = conn.server, listed.name
    timeout = server.timeout_s

    async def call(**arguments: Any) -> str:
        # The pool's deadline cancels this await; read_timeout is the session's own backstop.
        return await conn.call(remote, arguments, timeout or 300.0)
    schema = dict(listed.input_schema or {"type": "object", "properties": {}})
    return Tool(server.prefix + remote, listed.description or "", schema, call, timeout_s=timeout)


def _result_text(result: Any) -> str:
    parts = []
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _first_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, BaseExceptionGroup) and e.exceptions:
        return _first_line(e.exceptions[0])
    return text.splitlines()[0]
