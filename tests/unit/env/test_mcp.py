"""MCP servers' tools in the environment pool: a real server written with the mcp SDK (tests/unit/env/mcp_server.py),
over stdio and over streamable HTTP; its schema reaches the model, a call reaches the server; a server that hangs
is cut at the tool deadline and one that dies is a counted crash, started again by the next call, quarantined by
the breaker when it keeps failing; bad entries are one line."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.env.pool import EnvPool, PoolLimits
from conveyor.env.tool_env import ToolEnv
from conveyor.env.tools.mcp import McpServer, mcp_tools

SERVER = str(Path(__file__).with_name("mcp_server.py"))
STDIO = {"name": "calc", "command": sys.executable, "args": [SERVER]}


def call(name: str, **arguments) -> str:
    import json
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def steps(actions, servers, **limits):
    """Each action through one pool session of a ToolEnv with the servers' tools; (answers, counts, seconds)."""
    pool = EnvPool(lambda: ToolEnv(tools=(), mcp_servers=servers), PoolLimits(retries=0, **limits), "hermes")

    async def play():
        out, times = [], []
        async with pool.session() as s:
            for a in actions:
                t0 = time.perf_counter()
                result, names, failure = await s.step(a)
                times.append(time.perf_counter() - t0)
                out.append((result.observation, names, failure))
        return out, times
    try:
        out, times = asyncio.run(play())
        return out, pool.counts(), times
    finally:
        pool.close()


def test_stdio_server_tools_carry_their_schema_and_answer():
    tools, release = mcp_tools([STDIO])
    try:
        by_name = {t.name: t for t in tools}
        assert set(by_name) == {"multiply", "sleepy", "die", "fail"}
        schema = by_name["multiply"].parameters
        assert schema["type"] == "object" and schema["required"] == ["a", "b"]
        assert schema["properties"]["a"]["type"] == "integer" and by_name["multiply"].description.startswith("Multiply")
        assert asyncio.run(by_name["multiply"].fn(a=6, b=7)) == "42"
    finally:
        release()


def test_a_call_in_an_episode_step_reaches_the_server_and_a_tool_error_is_read_by_the_model():
    out, counts, _ = steps([call("multiply", a=123, b=456), call("fail", reason="no"),
                            call("multiply", a="x", b=1)], [STDIO])
    assert out[0] == ("multiply: 56088", ("multiply",), "")
    assert out[1][0].startswith("error: fail:") and out[1][2] == "crash"          # the server said isError
    assert out[2][0].startswith("error:") and out[2][2] == "bad_arguments"        # checked against its schema
    assert counts["tool_calls"] == 3 and counts["crash"] == 1 and counts["bad_arguments"] == 1


def test_a_hung_server_is_cut_at_the_tool_deadline_and_the_next_call_works():
    out, counts, times = steps([call("sleepy", seconds=30), call("multiply", a=2, b=3)], [STDIO], tool_timeout_s=1.0)
    assert out[0][2] == "timeout" and "did not return within 1.0s" in out[0][0]
    assert times[0] < 20.0, times  # no-hang bound: the 1 s deadline (and the server's start), not its 30 s sleep
    assert out[1][0] == "multiply: 6" and counts["timeout"] == 1


def test_a_server_that_dies_is_a_counted_crash_restarted_by_the_next_call_and_quarantined_if_it_keeps_dying():
    out, counts, _ = steps([call("die"), call("multiply", a=4, b=3)], [STDIO])
    assert out[0][2] == "crash" and out[1][0] == "multiply: 12" and counts["crash"] == 1
    out, counts, _ = steps([call("die"), call("die"), call("die")], [STDIO], breaker_failures=2,
                           breaker_cooldown_s=60)
    assert [o[2] for o in out] == ["crash", "crash", "quarantined"]
    assert "quarantined" in out[2][0] and counts["quarantined"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server_tools_work_in_the_pool():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # the server is up once its port accepts
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the MCP HTTP server did not start"
                time.sleep(0.1)
        server = {"url": f"http://127.0.0.1:{port}/mcp", "prefix": "web_"}
        out, counts, _ = steps([call("web_multiply", a=6, b=7)], [server])
        assert out[0] == ("web_multiply: 42", ("web_multiply",), "") and counts["tool_calls"] == 1
    finally:
        proc.kill()
        proc.wait(10)


def test_bad_entries_and_unreachable_servers_are_one_line():
    with pytest.raises(ValueError, match=r"mcp_servers\[0\] needs exactly one of command"):
        McpServer.parse({"args": ["x"]})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['cmd'\]"):
        McpServer.parse({"cmd": "x"})
    with pytest.raises(RuntimeError, match="MCP server 'nope' cannot be reached"):
        mcp_tools([{"name": "nope", "command": "/nonexistent/mcp-server", "start_timeout_s": 5}])
    with pytest.raises(ValueError, match=r"offered twice; give the servers a 'prefix'"):
        mcp_tools([STDIO, {**STDIO, "name": "again", "args": [SERVER, "--again"]}])
