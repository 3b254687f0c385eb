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
import warnings
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


# ---- limits of the sandbox as a whole (sandbox_limits.py): every backend this machine has, and "auto"

LIMITS_BACKENDS = ("auto", "supervisor", "cgroup1", "cgroup2")


def _sandbox_on(backend: str, unsafe: bool = False, once: bool = True, **limits) -> PythonSandbox:
    """A sandbox whose whole-sandbox limits use ``backend``; a cgroup backend this machine lacks
    skips, and with ``once`` so does the backend that ``auto`` picks here (its [auto] case runs it)."""
    from conveyor.sandbox_limits import pick
    if once and backend != "auto" and backend == pick("auto").name:
        pytest.skip(f"{backend} is what auto picks here: the [auto] case runs it")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # unsafe=True warns: asked for here
            return PythonSandbox(SandboxLimits(**limits), limits_backend=backend, unsafe=unsafe)
    except SandboxUnavailable as e:
        if backend in ("auto", "supervisor"):
            raise
        pytest.skip(f"no {backend} here: {e}")


def _spread(children: int, mb: int, hold: bool) -> str:
    """Forks ``children`` that each touch ``mb`` MB and keep it; ALL HELD once every one has; then
    (``hold``) waits to be killed, or ends them and itself."""
    return (f"import os, time\nkids = []\nfor i in range({children}):\n    r, w = os.pipe()\n"
            f"    kids.append(os.fork())\n    if kids[-1] == 0:\n        b = bytearray({mb} << 20)\n"
            "        os.write(w, b'x')\n        time.sleep(600)\n        os._exit(0)\n    os.read(r, 1)\n"
            f"print('ALL HELD', flush=True)\ntime.sleep({600 if hold else 0})\nfor k in kids:\n    os.kill(k, 9)\n")


@needs_bwrap
@pytest.mark.parametrize("backend", LIMITS_BACKENDS)
def test_memory_spread_over_children_is_limited_for_the_whole_sandbox(backend):
    wall = _wall(30.0)
    sb = _sandbox_on(backend, memory_mb=512, wall_s=wall)
    assert sb.limits_backend in ("cgroup2", "cgroup1", "supervisor")
    t0 = time.monotonic()
    # 6 x 150 MB: each child is far below RLIMIT_AS, together they are not. The parent holds on
    # until it is killed: only a limit on the whole sandbox stops this before the wall deadline.
    over = sb.run(_spread(6, 150, hold=True))
    assert over.violation == "memory" and not over.timed_out and over.exit_code is None, over
    assert time.monotonic() - t0 < wall + SLACK_S
    fits = sb.run(_spread(6, 50, hold=False))  # 300 MB together, and the interpreters: under 512 MB
    assert fits.violation is None and fits.exit_code == 0 and fits.stdout == "ALL HELD\n", fits
    with pytest.raises(ToolError) as e:
        python_tool(sb).fn(code=_spread(6, 150, hold=True))
    assert e.value.kind == "sandbox_violation" and "(memory)" in str(e.value)
    loose = _sandbox_on(backend, unsafe=True, memory_mb=512, wall_s=wall)  # the same without bubblewrap
    assert loose.run(_spread(6, 150, hold=True)).violation == "memory"
    assert loose.run(_spread(6, 50, hold=False)).stdout == "ALL HELD\n"


_CPU = ("import os, time\nkids = []\nfor i in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
        "        while time.process_time() < {each}:\n            pass\n        os._exit(0)\n    kids.append(pid)\n"
        "for k in kids:\n    os.waitpid(k, 0)\nprint('DONE')\n")


@needs_bwrap
@pytest.mark.parametrize("backend", LIMITS_BACKENDS)
def test_cpu_time_summed_over_children_is_limited(backend):
    wall = _wall(120.0)  # CPU seconds, not wall seconds, decide this: the deadline only bounds a hang
    sb = _sandbox_on(backend, cpu_s=1, wall_s=wall)
    # four children of 0.8 CPU seconds each: every one below its own RLIMIT_CPU of 1 s, 3.2 s together
    r = sb.run(_CPU.format(each=0.8))
    assert r.violation == "cpu_time" and not r.timed_out and "DONE" not in r.stdout, r
    ok = sb.run(_CPU.format(each=0.1))  # 0.4 s together
    assert ok.violation is None and ok.stdout == "DONE\n", ok


_FORKS = ("import os, time\nn, kids = 0, []\nfor i in range(40):\n    try:\n        pid = os.fork()\n"
          "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(600)\n        os._exit(0)\n"
          "    n += 1\n    kids.append(pid)\nprint(n, flush=True)\nif n == 40:\n    time.sleep(600)\n"
          "for k in kids:\n    os.kill(k, 9)\n")


def _none_running(tag: str) -> bool:
    """No process named ``tag`` is left but zombies (unsafe mode: killed processes that the host's
    init reaps when it gets to them), within a generous bound for the kernel to finish the kills."""
    give_up = time.monotonic() + SLACK_S
    while True:
        running = []
        for pid in _comm_alive(tag):
            try:
                running += [pid] if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" else []
            except OSError:
                pass  # reaped meanwhile
        if not running or time.monotonic() > give_up:
            return not running
        time.sleep(0.05)


@needs_bwrap
@pytest.mark.parametrize("backend", LIMITS_BACKENDS)
def test_process_limit_stops_a_fork_bomb(backend):
    wall = _wall(30.0)
    tag = "forks" + secrets.token_hex(4)
    code = f"open('/proc/self/comm', 'w').write({tag!r})\n" + _FORKS
    r = _sandbox_on(backend, processes=16, wall_s=wall).run(code)
    assert r.violation is None and 0 < int(r.stdout) < 16, r  # forks past the limit fail; the program goes on
    # unsafe mode as root: RLIMIT_NPROC binds no root, so only the whole-sandbox limit counts:
    # pids.max makes the forks fail, or the supervisor counts the tree and kills it
    loose = _sandbox_on(backend, unsafe=True, processes=16, wall_s=wall)
    unsafe = loose.run(code)
    assert unsafe.violation == "processes" or (unsafe.violation is None and int(unsafe.stdout) < 16), unsafe
    if os.geteuid() == 0 and unsafe.violation is None:
        assert loose.limits_backend != "supervisor"  # as root only the kernel's pids.max makes forks fail
    if os.geteuid() == 0 and loose.limits_backend == "supervisor":
        assert unsafe.violation == "processes" and not unsafe.timed_out
    assert _none_running(tag)


@needs_bwrap
@pytest.mark.parametrize("backend", ("cgroup1", "cgroup2"))
def test_cgroups_are_removed_after_every_run(backend, monkeypatch):
    sb = _sandbox_on(backend, once=False, memory_mb=256, wall_s=_wall(30.0))
    b = sb._backend
    parents = {p for p in (b.memory, b.pids, b.cpu) if p}

    def ours() -> list[str]:
        return [f"{p}/{n}" for p in parents for n in os.listdir(p) if n.startswith("conveyor-sandbox-")]

    before = ours()  # other runs on this machine may have theirs
    assert sb.run("print('ok')").stdout == "ok\n"
    assert sb.run(_spread(4, 150, hold=True)).violation == "memory"
    import conveyor.sandbox as sandbox_module

    def broken(*a, **k):
        raise RuntimeError("the output reader broke")
    monkeypatch.setattr(sandbox_module, "_pump", broken)
    tag = "cg" + secrets.token_hex(4)
    with pytest.raises(RuntimeError, match="output reader broke"):
        sb.run(f"import time\nopen('/proc/self/comm', 'w').write({tag!r})\ntime.sleep(600)")
    assert set(ours()) <= set(before) and _comm_alive(tag) == []


def test_limits_backend_is_named_and_checked():
    from conveyor.sandbox_limits import BACKENDS, pick
    with pytest.raises(ValueError, match="unknown sandbox limits backend 'cgroup3': use one of auto, cgroup2"):
        pick("cgroup3")
    assert pick("auto").name in BACKENDS and pick("supervisor").name == "supervisor"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        sb = PythonSandbox(SandboxLimits(wall_s=5), unsafe=True, bwrap="/nonexistent/bwrap")
    assert sb.limits_backend == pick("auto").name


def test_cgroup2_files_written_and_read(tmp_path, caplog):
    """The cgroup v2 path against a stand-in folder (CI's cgroup2 has no controllers delegated):
    the limits it writes, the events it reads, the command that joins it."""
    from conveyor.sandbox_limits import Backend, RunLimits, Totals
    run = RunLimits(Backend("cgroup2", memory=str(tmp_path), pids=str(tmp_path), cpu=str(tmp_path)),
                    Totals(memory_bytes=512 << 20, tasks=32, cpu_s=5), launcher=2)
    [folder] = run.folders.values()
    read = {n: (Path(folder) / n).read_text() for n in ("memory.max", "memory.swap.max", "memory.oom.group", "pids.max")}
    assert read == {"memory.max": str(512 << 20), "memory.swap.max": "0", "memory.oom.group": "1", "pids.max": "34"}
    argv = run.argv(["bwrap", "x"])
    assert argv[:2] == ["/bin/sh", "-c"] and argv[-4:] == [f"{folder}/cgroup.procs", "--", "bwrap", "x"]
    run.watch(os.getpid(), None)
    assert run.exceeded() is None
    (Path(folder) / "cpu.stat").write_text("usage_usec 5200000\nuser_usec 5000000\n")
    assert run.exceeded() == "cpu_time"
    (Path(folder) / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert run.exceeded() == "memory" and run.oom_killed()
    with caplog.at_level(logging.WARNING, logger="conveyor.sandbox_limits"):
        run.close()  # a real cgroup folder is removed with its files in it; this stand-in is not
    assert "could not remove the cgroup" in caplog.text and run.folders == {}
