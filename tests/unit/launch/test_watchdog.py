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

from conveyor.launch import watchdog
from conveyor.launch.procs import RoleError, RoleProcess, RpcClient, serve_rpc

ROOT = str(Path(__file__).resolve().parents[3])


class Stuck:
    def ping(self) -> str:
        return "pong"

    def hang(self) -> None:
        stuck_in_here()


def stuck_in_here() -> None:
    while True:
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
        assert time.monotonic() - t0 < 2.0 + 5.0  # the dump adds a moment, not another deadline
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
from tests.unit.launch.test_watchdog import _serve
from conveyor.launch.procs import RoleProcess
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
