"""A wait that runs out names where every role was: the stacks of a stuck role process reach its
log and the error; role processes do not outlive their parent; deadlines grow with what was seen."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.runtime import watchdog
from conveyor.runtime.procs import RoleError, RoleProcess, RpcClient, serve_rpc

ROOT = str(Path(__file__).resolve().parents[3])


class Stuck:
    def ping(self) -> str:
        return "pong"

    def hang(self) -> None:
        stuck_in_here()


def stuck_in_here() -> None:
    while True:
        time.sleep(0.05)


def stuck_until(stop) -> None:
    while not stop.is_set():
        time.sleep(0.05)


def _serve(conn) -> None:
    serve_rpc(Stuck(), conn)


def test_a_call_past_its_deadline_names_where_the_other_side_was(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(ROOT)  # the spawned child imports this module by name
    watchdog.configure(tmp_path / "logs")  # what a run does as it starts
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = RoleProcess("stuckrole", _serve, (child,), tmp_path / "logs", ctx)
    rpc = RpcClient(parent, proc)
    try:
        assert rpc.call("ping", timeout=120) == "pong"
        t0 = time.monotonic()
        with pytest.raises(RoleError) as err:
            rpc.call("hang", timeout=2.0)
        # No-hang bound: the 2 s deadline and the dump's 0.5 s settle idle (the message names the deadline).
        assert time.monotonic() - t0 < 30.0
        text = str(err.value)
        assert "stuckrole.hang did not answer within 2s" in text
        assert "stuckrole (pid" in text and "stuck_in_here (test_watchdog.py:" in text, text
        log = (tmp_path / "logs" / "stuckrole.log").read_text()
        assert "stuck_in_here" in log and "Thread 0x" in log  # every thread's stack, in the role's log
        assert "stacks of every thread" in (tmp_path / "logs" / "controller.log").read_text()
    finally:
        proc.stop(timeout=0)


_PARENT = """
import multiprocessing as mp, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from tests.unit.runtime.test_watchdog import _serve
from conveyor.runtime.procs import RoleProcess
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = RoleProcess("orphan", _serve, (child,), Path({logs!r}), ctx)
    print(p.proc.pid, flush=True)
    time.sleep(600)
"""


def test_a_role_process_ends_when_its_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(_PARENT.format(root=ROOT, logs=str(tmp_path / "logs")))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    log = tmp_path / "logs" / "orphan.log"
    deadline = time.monotonic() + 120
    while "started pid" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + watchdog.PARENT_POLL_S * 10
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child), "the role outlived its parent"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_deadlines_grow_with_the_longest_wait_seen():
    d = watchdog.Deadlines(10.0, growth=4.0)
    assert d.of("train") == 10.0
    d.observe("train", 1.0)
    assert d.of("train") == 10.0  # never below the configured deadline
    d.observe("train", 5.0)
    d.observe("train", 2.0)
    assert d.of("train") == 20.0 and d.of("groups") == 10.0


def test_a_remote_role_reports_its_stacks_and_a_silent_one_says_so(tmp_path):
    # A role the controller cannot signal (a Ray actor) hands its own dump back; here the dump
    # is this process's, with a thread stuck in stuck_in_here (a frame of this package's tests).
    import threading
    watchdog.configure(tmp_path / "logs")
    stop = threading.Event()
    stuck = threading.Thread(target=stuck_until, args=(stop,), daemon=True)
    stuck.start()

    def silent(timeout: float) -> str:
        raise TimeoutError(f"no answer within {timeout:.0f}s")
    watchdog.register_remote("remote0", lambda timeout: watchdog.own_stacks())
    watchdog.register_remote("remote1", silent)
    try:
        lines = watchdog.dump_stacks("a test's wait").splitlines()
    finally:
        watchdog.unregister_remote("remote0")
        watchdog.unregister_remote("remote1")
        stop.set()
    (line0,) = [ln for ln in lines if ln.startswith("remote0:")]
    # The line names up to three busy threads; other tests' threads may be busy in this process too.
    assert "remote0.stacks.log" in line0, line0
    log = (tmp_path / "logs" / "remote0.stacks.log").read_text()
    assert "a test's wait" in log and "in stuck_until" in log
    (line1,) = [ln for ln in lines if ln.startswith("remote1:")]
    assert "no stacks (TimeoutError: no answer within 5s)" in line1, line1
    assert not (tmp_path / "logs" / "remote1.stacks.log").exists()
    assert "remote0" not in watchdog.dump_stacks("after")


def test_a_call_stops_with_the_error_of_a_role_that_failed_meanwhile(tmp_path, monkeypatch):
    # A trainer call that waits on an engine which died (its publish waits for the engine's receipt)
    # must stop with the engine's error, not run out its own deadline and name the trainer.
    import threading

    from conveyor.launch.roles import TrainerProxy
    monkeypatch.syspath_prepend(ROOT)
    watchdog.configure(tmp_path / "logs")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = RoleProcess("stuckrole", _serve, (child,), tmp_path / "logs", ctx)
    proxy = TrainerProxy([RpcClient(parent, proc)], timeout=600.0)
    error: list = [None]
    proxy.stop_if(lambda: error[0])
    try:
        assert proxy._all("ping") == "pong"  # nothing failed yet: calls answer as before
        failed_at = time.monotonic() + 1.0
        threading.Timer(1.0, lambda: error.__setitem__(0, RoleError("engine 0 failed:\nits traceback"))).start()
        with pytest.raises(RoleError) as err:
            proxy._all("hang")
        assert time.monotonic() - failed_at < 60  # not the call's 600 s deadline
        text = str(err.value)
        assert text.startswith("engine 0 failed:\nits traceback"), text
        assert "while stuckrole.hang was running" in text
    finally:
        proc.stop(timeout=0)


def test_a_role_start_stops_with_the_error_of_a_role_that_failed_meanwhile(tmp_path, monkeypatch):
    # The trainer starts after the engines: an engine that dies while the trainer loads must stop
    # the run then, not once the trainer is up (or its start deadline ran out).
    import threading

    from conveyor.launch.roles import _await
    monkeypatch.syspath_prepend(ROOT)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = RoleProcess("stuckrole", _serve, (child,), tmp_path / "logs", ctx)  # never says it is ready
    error: list = [None]
    try:
        failed_at = time.monotonic() + 1.0
        threading.Timer(1.0, lambda: error.__setitem__(0, RoleError("engine 0 died: SIGKILL"))).start()
        with pytest.raises(RoleError) as err:
            _await(lambda: parent.poll(0.1), proc, 600.0, "stuckrole", (), lambda: error[0])
        assert time.monotonic() - failed_at < 60  # not the start's 600 s deadline
        assert str(err.value) == "engine 0 died: SIGKILL\n(the run stopped while stuckrole was starting)"
        proc.check()  # still running: stopping it is the caller's (start_trainer stops every rank)
    finally:
        proc.stop(timeout=0)


def test_a_wait_that_runs_out_is_a_role_error_with_every_roles_stacks(tmp_path):
    from concurrent.futures import Future
    watchdog.configure(tmp_path / "logs")
    with pytest.raises(RoleError) as e:
        watchdog.result(Future(), 0.01, "the evaluation's 8 generations (eval)")
    msg = str(e.value)
    assert msg.startswith("the evaluation's 8 generations (eval) did not finish within 0.01s (launch.timeout_s)")
    assert f"controller: stacks in {tmp_path / 'logs' / 'controller.log'}" in msg
    done = Future()
    done.set_result(7)
    assert watchdog.result(done, 0.01, "x") == 7


# Every other wait on a future with a deadline, and why it may run out on its own: a new one
# either goes through watchdog.result or is added here with its reason.
OWN_DEADLINES = {
    ("runtime/watchdog.py", "future.result"): "the watchdog's own wait",
    ("env/tools/mcp.py", "fut.result"): "an MCP server's start: a tool failure the pool counts",
    ("env/tools/mcp.py", "asyncio.run_coroutine_threadsafe(settle(), self._loop).result"): "closing a server",
    ("reward/calls.py", "fut.result"): "a reward call's deadline: the reward's fallback, counted",
    ("episodes/runner.py", "asyncio.run_coroutine_threadsafe(self.agents.stop(), self._loop).result"):
        "closing the agents' endpoint",
    ("episodes/runner.py", "asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result"):
        "closing the episodes' loop",
}


def test_every_wait_on_a_future_goes_through_the_watchdog_or_says_why_not():
    import ast
    src = Path(__file__).resolve().parents[3] / "src" / "conveyor"
    raw = set()
    for path in src.rglob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "result"
                    and (node.args or any(k.arg == "timeout" for k in node.keywords))
                    and ast.get_source_segment(text, node.func) != "watchdog.result"):
                raw.add((str(path.relative_to(src)), ast.get_source_segment(text, node.func)))
    assert raw - set(OWN_DEADLINES) == set(), "wait through runtime.watchdog.result (or list it in OWN_DEADLINES)"
    assert set(OWN_DEADLINES) - raw == set(), "OWN_DEADLINES names waits that are gone"
