"""The sandbox escape suite: each attempt is blocked AND the host is unharmed.

Runs where bubblewrap is installed (CI runs as root with it); skips only where ``bwrap`` is
missing. Deadlines are small but generous; nothing asserts speed.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from conveyor.env.api import ToolError
from conveyor.env.tools.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailable, python_tool

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
SLACK_S = 20.0  # generous: a loaded 2-core CI machine must not fail these


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(SandboxLimits(wall_s=10))


def _comm_alive(tag: str) -> list[int]:
    """Host pids whose command name is ``tag`` (children inherit it across fork)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if Path(f"/proc/{d}/comm").read_text().strip() == tag:
                    pids.append(int(d))
            except OSError:
                pass  # gone meanwhile
    return pids


@needs_bwrap
def test_normal_program_and_tool_output(sandbox):
    r = sandbox.run("import sys\nprint(sum(range(10)))\nprint(sys.stdin.read().upper())", stdin="hello")
    assert (r.stdout, r.exit_code, r.violation, r.timed_out, r.truncated) == ("45\nHELLO\n", 0, None, False, False)
    tool = python_tool(sandbox)
    assert tool.schema()["function"]["parameters"] == {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
    assert tool.fn(code="print(6 * 7)") == "42\n"
    text = tool.fn(code="import sys\nprint('out')\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert "out" in text and "oops" in text and "exit code 3" in text
    with pytest.raises(ToolError) as e:
        tool.fn(code=123)
    assert e.value.kind == "bad_arguments"


@needs_bwrap
def test_runs_unprivileged(sandbox):
    r = sandbox.run("import os\nst = open('/proc/self/status').read()\n"
                    "print(os.getuid(), os.getgid(), os.getgroups())\n"
                    "print([l for l in st.splitlines() if l.startswith(('CapEff', 'CapPrm', 'NoNewPrivs'))])")
    uid, gid, groups = r.stdout.splitlines()[0].split(" ", 2)
    assert uid != "0" and gid != "0" and groups == "[]"
    assert "CapEff:\\t0000000000000000" in r.stdout and "CapPrm:\\t0000000000000000" in r.stdout
    assert "NoNewPrivs:\\t1" in r.stdout


@needs_bwrap
def test_no_network(sandbox):
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(8)
    host.setblocking(False)
    port = host.getsockname()[1]
    try:
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                "    print('CONNECTED')\nexcept OSError as e:\n    print('connect failed', e)\n"
                "try:\n    print('RESOLVED', socket.getaddrinfo('example.com', 80))\n"
                "except OSError as e:\n    print('dns failed', e)\nprint(socket.if_nameindex())")
        r = sandbox.run(code)
        assert "connect failed" in r.stdout and "CONNECTED" not in r.stdout, r
        assert "dns failed" in r.stdout and "RESOLVED" not in r.stdout, r
        assert "[(1, 'lo')]" in r.stdout  # a private loopback and nothing else
        with pytest.raises(BlockingIOError):
            host.accept()  # nothing reached the host's listener
    finally:
        host.close()


@needs_bwrap
def test_host_files_unreadable(sandbox, tmp_path):
    secret = tmp_path / "run_dir_secret.txt"  # a stand-in for the run directory
    secret.write_text("TOP-SECRET")
    paths = ["/etc/shadow", str(secret), str(Path(__file__).resolve()), os.path.expanduser("~/.bash_history")]
    code = (f"for p in {paths!r}:\n    try:\n        print('READ', p, open(p).read()[:20])\n"
            "    except OSError as e:\n        print('denied', p, type(e).__name__)")
    r = sandbox.run(code)
    assert r.stdout.count("denied") == len(paths) and "READ" not in r.stdout, r
    assert "TOP-SECRET" not in r.stdout + r.stderr
    tool_text = python_tool(sandbox).fn(code=f"import os\nprint(os.path.exists({str(tmp_path)!r}))")
    assert tool_text == "False\n"


@needs_bwrap
def test_writes_outside_tmp_fail_and_host_unchanged(sandbox, tmp_path):
    tag = secrets.token_hex(6)
    targets = [f"/usr/evil-{tag}", f"{sys.prefix}/evil-{tag}", f"{sys.base_prefix}/evil-{tag}",
               f"{tmp_path}/evil-{tag}", f"/evil-{tag}", f"/etc/evil-{tag}"]
    code = (f"for p in {targets!r}:\n    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
            "    except OSError as e:\n        print('denied', p, type(e).__name__)\n"
            f"open('/tmp/ok-{tag}', 'w').write('fine')\nprint(open('/tmp/ok-{tag}').read())")
    before = sorted(os.listdir(tmp_path))
    r = sandbox.run(code)
    assert "WROTE" not in r.stdout and r.stdout.count("denied") == len(targets), r
    assert r.stdout.rstrip().endswith("fine")  # /tmp is writable: it is the sandbox's own tmpfs
    assert not any(os.path.exists(t) for t in targets)
    assert sorted(os.listdir(tmp_path)) == before and not os.path.exists(f"/tmp/ok-{tag}")


@needs_bwrap
def test_fork_bomb_contained_and_nothing_survives():
    wall = _wall(3.0)
    sb = PythonSandbox(SandboxLimits(wall_s=wall, processes=32))
    counted = sb.run("import os, time\nn = 0\nfor i in range(200):\n    try:\n        pid = os.fork()\n"
                     "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
                     "    n += 1\nprint(n)")
    assert counted.timed_out is False and 0 < int(counted.stdout) < 32, counted  # stopped by RLIMIT_NPROC
    tag = "bomb" + secrets.token_hex(5)
    bomb = (f"import os\nopen('/proc/self/comm', 'w').write({tag!r})\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    t0 = time.monotonic()
    r = sb.run(bomb)
    assert r.timed_out and r.violation == "timeout" and time.monotonic() - t0 < wall + SLACK_S
    assert _comm_alive(tag) == []  # the whole pid namespace is gone when run returns
    assert _comm_alive(tag) == [] and sb.run("print('still fine')").stdout == "still fine\n"


@needs_bwrap
def test_daemonised_child_killed_at_exit():
    sb = PythonSandbox(SandboxLimits(wall_s=20))  # ~0.6 s idle; well short of the daemon's 60 s
    tag = "dmn" + secrets.token_hex(5)
    r = sb.run(f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    open('/proc/self/comm', 'w').write({tag!r})\n"
               "    os.close(1); os.close(2)\n    time.sleep(60)\nelse:\n    time.sleep(0.5)\n    print('parent done')")
    assert r.stdout == "parent done\n" and not r.timed_out
    assert _comm_alive(tag) == []


@needs_bwrap
def test_memory_limit(sandbox):
    r = sandbox.run("x = bytearray(10 * 2**30)\nprint('ALLOCATED')")
    assert "ALLOCATED" not in r.stdout and r.violation == "memory" and "MemoryError" in r.stderr, r
    with pytest.raises(ToolError) as e:
        python_tool(sandbox).fn(code="x = bytearray(10 * 2**30)")
    assert e.value.kind == "sandbox_violation" and "memory" in str(e.value)


def _wall(at_least: float) -> float:
    """A wall deadline of ten times what a sandbox takes to start and print here, now (at least
    ``at_least``): on a loaded machine the interpreter's start alone can take seconds, and what a
    test expects to happen before the deadline must."""
    t0 = time.monotonic()
    assert PythonSandbox(SandboxLimits(wall_s=60)).run("print('started')").stdout == "started\n"
    return max(at_least, 10 * (time.monotonic() - t0))


@needs_bwrap
def test_infinite_loop_killed_at_wall_deadline():
    wall = _wall(2.0)
    sb = PythonSandbox(SandboxLimits(wall_s=wall, cpu_s=int(wall) + 60))
    t0 = time.monotonic()
    r = sb.run("print('started')\nwhile True:\n    pass")
    assert r.timed_out and r.violation == "timeout" and r.exit_code is None
    assert r.stdout == "started\n"  # what came before the deadline is kept
    assert time.monotonic() - t0 < wall + SLACK_S
    with pytest.raises(ToolError) as e:
        python_tool(sb).fn(code="import time\ntime.sleep(1000)")
    assert e.value.kind == "timeout"


@needs_bwrap
def test_cpu_limit():
    sb = PythonSandbox(SandboxLimits(wall_s=60, cpu_s=1))
    r = sb.run("while True:\n    pass")
    assert r.violation == "cpu_time" and not r.timed_out and r.exit_code == -24, r
    with pytest.raises(ToolError) as e:
        python_tool(sb).fn(code="while True:\n    pass")
    assert e.value.kind == "sandbox_violation"


@needs_bwrap
def test_output_flood_truncated():
    sb = PythonSandbox(SandboxLimits(wall_s=30, output_bytes=65536))
    r = sb.run("import sys\nchunk = 'x' * 2**20\nfor _ in range(100):\n    sys.stdout.write(chunk)")  # 100 MB
    assert r.truncated and r.violation == "output"
    assert r.stdout.count("x") == 65536 and len(r.stdout) < 65536 + 200 and "output cut" in r.stdout
    both = sb.run("import sys\nfor _ in range(100):\n    print('e' * 2**20, file=sys.stderr)")
    assert both.truncated and len(both.stdout) + len(both.stderr) < 65536 + 200


@needs_bwrap
def test_signalling_parent_and_pid1_leaves_host_alive(sandbox):
    code = ("import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
            "        print('sent', pid)\n    except OSError as e:\n        print('refused', pid, e.errno)\n"
            "print('after')")
    r = sandbox.run(code)
    assert r.stdout.endswith("after\n") and r.exit_code == 0, r  # its pid 1 is the sandbox's own init
    if os.geteuid() == 0:
        assert "refused 1" in r.stdout  # that init runs as root, the program as its own uid
    assert sandbox.run("print('alive')").stdout == "alive\n"  # this process, and the sandbox, live on


@needs_bwrap
def test_tmpfs_size_cap():
    sb = PythonSandbox(SandboxLimits(tmp_mb=4))
    big = f"/tmp/big-{secrets.token_hex(6)}"
    r = sb.run(f"import errno\ntry:\n    with open({big!r}, 'wb') as f:\n        for _ in range(16):\n"
               "            f.write(b'0' * 2**20)\n    print('WROTE 16 MB')\nexcept OSError as e:\n"
               "    print('full', errno.errorcode[e.errno])")
    assert "full ENOSPC" in r.stdout and "WROTE" not in r.stdout, r
    assert not os.path.exists(big)


def test_missing_bwrap_names_the_package():
    with pytest.raises(SandboxUnavailable) as e:
        PythonSandbox(SandboxLimits(), bwrap="/nonexistent/bwrap")
    msg = str(e.value)
    assert "apt-get install bubblewrap" in msg and "unsafe=True" in msg and "\n" not in msg


def test_unsafe_mode_warns_every_time(caplog):
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="conveyor.sandbox"), \
                pytest.warns(RuntimeWarning, match="UNSANDBOXED"):
            sb = PythonSandbox(SandboxLimits(wall_s=5), unsafe=True, bwrap="/nonexistent/bwrap")
        assert any("UNSANDBOXED" in rec.getMessage() for rec in caplog.records)
    r = sb.run("print(6 * 7)")
    assert r.stdout == "42\n" and r.exit_code == 0
    assert sb.run("x = bytearray(10 * 2**30)").violation == "memory"


def test_an_interpreter_under_the_hosts_tmp_is_bound_over_the_private_tmp(tmp_path):
    import venv
    venv.create(tmp_path / "venv", with_pip=False)  # e.g. a checkout under /tmp with its .venv
    sb = PythonSandbox(SandboxLimits(wall_s=10), python=str(tmp_path / "venv" / "bin" / "python"))
    r = sb.run("import sys; open('/tmp/x', 'w').write('ok'); print(sys.prefix, open('/tmp/x').read())")
    assert r.exit_code == 0 and r.stdout.strip() == f"{tmp_path / 'venv'} ok", r
    r = sb.run(f"open({str(tmp_path / 'venv' / 'pwned')!r}, 'w')")
    assert r.exit_code != 0 and "Error" in r.stderr and not (tmp_path / "venv" / "pwned").exists()
