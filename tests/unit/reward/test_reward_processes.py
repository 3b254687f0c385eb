"""ProcessRewardService: scoring in worker processes, killed deadlines, dead workers, the restart
rule, close, orphans, and the same results and counters as the thread service."""
import inspect
import logging
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conveyor.config import RewardConfig
from conveyor.observe import timeline
from conveyor.observe.timeline import Timeline, read_timeline
from conveyor.plugins import PluginError
from conveyor.reward.api import RewardHandle
from conveyor.reward.factory import RewardSpec, reward_service
from conveyor.reward.processes import ProcessRewardService
from conveyor.reward.service import RewardService
from conveyor.runtime.errors import RoleError
from conveyor.types import Task, Trajectory

ROOT = Path(__file__).resolve().parents[3]
W = "tests.unit.reward.worker_rewards:"


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    # Workers import the test rewards by name: the repository root goes on the path they inherit,
    # whichever way pytest was started.
    monkeypatch.syspath_prepend(str(ROOT))


def traj(i: int, text: str = "ok", answer: str = "42") -> Trajectory:
    return Trajectory(Task(f"t{i}", "q", answer), (1,), (5,), (-0.5,), (0,), (1,), text=text)


def pool(fn: str, kwargs: dict | None = None, **kw) -> ProcessRewardService:
    """A pool over ``fn``: a builtin, a dotted path, or a name in worker_rewards."""
    return ProcessRewardService(RewardSpec(fn if ":" in fn or fn == "math" else W + fn, kwargs or {}), **kw)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


def reward_workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("reward-")]


def test_scores_in_order_on_several_workers_without_blocking_the_caller():
    with pool("length", {"sleep_s": 0.3, "stamps": True}, timeout_s=10.0, workers=2) as svc:
        start = time.monotonic()
        futures = [svc.submit(traj(i, "x" * i)) for i in range(6)]
        submitted = time.time()
        out = [f.result(timeout=30) for f in futures]
        elapsed = time.monotonic() - start
        assert [t.reward for t in out] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert [t.task.id for t in out] == [f"t{i}" for i in range(6)]
        pids = {t.reward_info["pid"] for t in out}
        assert len(pids) == 2 and os.getpid() not in pids  # two worker processes shared the work
        calls = {p: [(t.reward_info["started"], t.reward_info["ended"]) for t in out if t.reward_info["pid"] == p]
                 for p in pids}
        a, b = calls.values()
        assert any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)  # in parallel: the two workers' calls overlap
        # submit only queues: the six were in before the last call ended (a submit that waited for
        # its score would return after it)
        assert submitted < max(e for _, e in a + b), (submitted, a, b)
        assert elapsed < 60.0  # no-hang bound: ~1 s idle
        assert all(t.timings["reward_s"] >= 0.3 for t in out)
        assert svc.stats() == {"scored": 6, "failures": 0, "timeouts": 0, "nonfinite": 0,
                               "worker_deaths": 0, "restarts": 0}
        assert svc.name == "length"  # the loaded reward's name, as the thread service gives it
    assert reward_workers() == []


def test_a_call_past_its_deadline_is_killed_and_the_pool_scores_on(tmp_path, caplog):
    pidfile = tmp_path / "hung.pid"
    with caplog.at_level(logging.WARNING, logger="conveyor.reward.processes"):
        with pool("hang_on", {"pidfile": str(pidfile)}, timeout_s=1.0, fallback=-0.5, workers=2) as svc:
            start = time.monotonic()
            out = svc.score([traj(0, "hang"), traj(1), traj(2), traj(3)])
            assert 1.0 <= time.monotonic() - start < 30.0  # no-hang bound: ~1.1 s idle; counted below
            assert [t.reward for t in out] == [-0.5, 1.0, 1.0, 1.0]
            assert out[0].reward_info == {"reward_error": "timeout"} and out[0].timings["reward_s"] == 1.0
            hung = int(pidfile.read_text())
            assert not alive(hung)  # killed, not abandoned
            assert svc.stats() == {"scored": 4, "failures": 0, "timeouts": 1, "nonfinite": 0,
                                   "worker_deaths": 0, "restarts": 1}
            # The replacement and the other worker score what follows, a second hang included.
            out = svc.score([traj(4), traj(5, "hang"), traj(6), traj(7)])
            assert [t.reward for t in out] == [1.0, -0.5, 1.0, 1.0]
            assert svc.stats()["timeouts"] == 2 and svc.stats()["restarts"] == 2
    lines = [r.getMessage() for r in caplog.records if "exceeded" in r.getMessage()]
    assert lines == ["reward 'hang_on' exceeded 1.00s on task 't0'; its worker process was killed and replaced, "
                     "fallback -0.5 used"]  # once, however many time out


@pytest.mark.parametrize("how", ["exit", "kill"])  # os._exit(3), SIGKILL
def test_a_worker_that_dies_is_replaced_and_its_item_rescored_elsewhere(tmp_path, how, caplog):
    marker = tmp_path / "died.pid"
    with pool("die_once", {"marker": str(marker), "how": how}, timeout_s=10.0, workers=2) as svc:
        with caplog.at_level(logging.WARNING, logger="conveyor.reward.processes"):
            out = svc.score([traj(0, "die"), traj(1), traj(2)])
        exit_text = "exit code 3" if how == "exit" else "signal SIGKILL"
        assert [r.getMessage() for r in caplog.records] == [
            f"reward 'die_once': a worker process exited with {exit_text} while scoring task 't0'; replaced (a "
            "trajectory is scored once more on another worker, then gets fallback 0.0)"]
        dead = int(marker.read_text())
        assert not alive(dead)
        # Rescored once, by a live worker: the reward is that worker's pid.
        assert out[0].reward != dead and "reward_error" not in out[0].reward_info
        assert all(t.reward > 0 for t in out)
        assert svc.stats() == {"scored": 3, "failures": 0, "timeouts": 0, "nonfinite": 0,
                               "worker_deaths": 1, "restarts": 1}


def test_an_item_that_kills_two_workers_gets_the_fallback_and_the_pool_goes_on():
    with pool("kill_on", timeout_s=10.0, fallback=0.25, workers=2) as svc:
        out = svc.score([traj(0, "kill"), traj(1), traj(2)])
        assert [t.reward for t in out] == [0.25, 2.0, 2.0]
        assert out[0].reward_info == {"reward_error": "worker died"}
        assert svc.stats() == {"scored": 3, "failures": 1, "timeouts": 0, "nonfinite": 0,
                               "worker_deaths": 2, "restarts": 2}
        assert [t.reward for t in svc.score([traj(3), traj(4)])] == [2.0, 2.0]


def test_deaths_in_a_row_past_max_restarts_stop_the_service_naming_the_reward():
    with pool("kill_on", timeout_s=10.0, workers=1, max_restarts=2) as svc:
        first = svc.submit(traj(0, "kill"))
        second = svc.submit(traj(1, "kill"))
        # Two deaths in a row are within the budget: the first item gets the fallback ...
        assert first.result(timeout=30).reward_info == {"reward_error": "worker died"}
        # ... the third in a row is one too many.
        with pytest.raises(RoleError, match=r"reward 'kill_on': 3 worker processes died in a row .*"
                                            r"reward.max_restarts=2.*signal SIGKILL"):
            second.result(timeout=30)
        with pytest.raises(RoleError):  # a later submit gets the error, not a wait
            svc.submit(traj(2)).result(timeout=1)
        assert svc.stats()["worker_deaths"] == 3
    assert reward_workers() == []


def test_math_verify_times_out_by_its_own_alarm_inside_a_worker():
    # Comparing 42 with 9^(9^9) runs for minutes without a limit; math-verify's signal.alarm works
    # on a worker's main thread, so the call ends at its 1 s limit as a plain wrong answer, long
    # before the service's deadline would kill the worker.
    with pool("math", {"verify_timeout_s": 1}, timeout_s=60.0, workers=1) as svc:
        start = time.monotonic()
        slow, right = svc.score([traj(0, "\\boxed{9^{9^{9}}}"), traj(1, "\\boxed{42}")])
        assert time.monotonic() - start < 20.0
        assert (slow.reward, slow.reward_info) == (0.0, {"parsed": 1.0})
        assert right.reward == 1.0
        assert svc.stats() == {"scored": 2, "failures": 0, "timeouts": 0, "nonfinite": 0,
                               "worker_deaths": 0, "restarts": 0}


def test_close_with_work_pending_cancels_the_queue_and_stops_the_workers():
    svc = pool("length", {"sleep_s": 1.0}, timeout_s=10.0, workers=1)
    futures = [svc.submit(traj(i, "ab")) for i in range(4)]
    deadline = time.monotonic() + 60.0
    while not futures[0].running():  # the first is running: its worker has it
        assert time.monotonic() < deadline, "the first call never started"
        time.sleep(0.01)
    start = time.monotonic()
    svc.close()
    assert time.monotonic() - start < 30.0  # no-hang bound: ~1.5 s idle (the running call, the workers' exit)
    assert all(f.done() for f in futures)
    assert futures[0].result().reward == 2.0  # the running call finished
    assert all(f.cancelled() for f in futures[1:])
    assert reward_workers() == []
    svc.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="is closed"):
        svc.submit(traj(9))


PARENT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from conveyor.reward.factory import RewardSpec
    from conveyor.reward.processes import ProcessRewardService
    from conveyor.types import Task, Trajectory

    if __name__ == "__main__":
        svc = ProcessRewardService(RewardSpec("tests.unit.reward.worker_rewards:hang_on"), timeout_s=600,
                                   workers=2)
        # One worker busy in a call that never ends, one idle.
        busy = svc.submit(Trajectory(Task("t", "q", "a"), (1,), (5,), (-0.5,), (0,), (1,), text="hang"))
        while not busy.running():  # its worker has it
            time.sleep(0.01)
        print("ready", flush=True)
        time.sleep(600)
""")


def test_a_sigkilled_parent_leaves_no_worker_processes(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(root=str(ROOT)))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        assert parent.stdout.readline().strip() == "ready"
        workers = children(parent.pid)
        # The two workers (and multiprocessing's resource tracker).
        assert len([p for p in workers if "spawn_main" in _cmdline(p)]) == 2
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5.0
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in workers if alive(p)] == []
    finally:  # what a failed check left behind
        if parent.poll() is None:
            workers += children(parent.pid)
            parent.kill()
            parent.wait(10)
        for p in workers:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_reward_that_cannot_load_in_a_worker_is_one_line_before_the_run(tmp_path, monkeypatch):
    cfg = RewardConfig(executor="process", fn="nowhere.module:fn")
    with pytest.raises(PluginError) as e:
        reward_service(cfg, RewardSpec(cfg.fn))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("reward 'nowhere.module:fn' cannot be loaded in a reward worker process: ")
    assert "cannot import module 'nowhere.module'" in str(e.value)
    # Importable here, not in a fresh process: only the workers can tell.
    (tmp_path / "parent_only.py").write_text(
        "import multiprocessing\nif multiprocessing.parent_process() is not None:\n"
        "    raise ImportError('needs what the controller set up')\ndef fn(traj):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert RewardSpec("parent_only:fn").load()(traj(0)) == 1.0
    with pytest.raises(PluginError, match=r"^reward 'parent_only:fn' cannot be loaded in a reward worker process: "
                                          r".*needs what the controller set up[^\n]*$"):
        pool("parent_only:fn", workers=2)
    assert reward_workers() == []


@pytest.mark.parametrize("fn, kwargs", [
    ("raises", {}),
    ("returns", {"value": math.nan}),
    ("returns", {"value": {"reward": math.inf, "k": 1.0}}),
    ("returns", {"value": "1.0"}),
    ("returns", {"value": {"score": 1.0}}),
    ("returns", {"value": True}),
    ("returns", {"value": {"reward": 0.5, "parsed": 1.0}}),
])
def test_results_and_counters_are_the_thread_services(fn, kwargs, caplog):
    spec = RewardSpec(W + fn, kwargs)
    with caplog.at_level(logging.WARNING):
        with RewardService(spec.load(), timeout_s=5.0, fallback=0.25, workers=1) as threads:
            by_threads = threads.score([traj(0), traj(1)])
            counts = threads.stats()
        thread_lines = [r.getMessage().splitlines()[0] for r in caplog.records]
        caplog.clear()
        with pool(fn, kwargs, timeout_s=5.0, fallback=0.25, workers=1) as procs:
            by_procs = procs.score([traj(0), traj(1)])
            assert procs.stats() == {**{k: v for k, v in counts.items() if k != "stuck"},
                                     "worker_deaths": 0, "restarts": 0}
        proc_lines = [r.getMessage().splitlines()[0] for r in caplog.records]
    assert [(t.reward, t.reward_info) for t in by_procs] == [(t.reward, t.reward_info) for t in by_threads]
    assert proc_lines == thread_lines  # the same line, once
    if fn == "raises":  # the worker's traceback comes along as text
        assert "KeyError: 'boom'" in caplog.records[0].getMessage()


def test_one_timeline_row_per_worker(tmp_path):
    tl = Timeline(tmp_path)
    timeline.activate(tl)
    try:
        with pool("length", {"sleep_s": 0.2}, timeout_s=10.0, workers=2) as svc:
            svc.score([traj(i) for i in range(4)])
    finally:
        timeline.deactivate(tl)
        tl.close()
    events = read_timeline(tmp_path)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X" and e["name"] == "score"]
    assert len(spans) == 4 and all(s["args"] == {"task": s["args"]["task"]} for s in spans)
    assert sorted({threads[(s["pid"], s["tid"])] for s in spans}) == ["reward-length-process0",
                                                                      "reward-length-process1"]
    assert all(s["dur"] >= 0.2e6 for s in spans)


def test_the_same_public_interface_as_the_thread_service():
    members = [m for m in vars(RewardHandle) if not m.startswith("_") or m in ("__enter__", "__exit__")]
    members = [m for m in members if callable(getattr(RewardHandle, m))]
    assert sorted(members) == ["__enter__", "__exit__", "close", "score", "stats", "submit"]
    for m in members:
        assert inspect.signature(getattr(ProcessRewardService, m)).parameters.keys() == \
               inspect.signature(getattr(RewardService, m)).parameters.keys(), m
    public = {m for m in vars(ProcessRewardService) if not m.startswith("_")}
    assert public == {"submit", "score", "stats", "close"}
    with pytest.raises(ValueError, match="reward.max_restarts"):
        ProcessRewardService(RewardSpec("math"), max_restarts=-1)
    with pytest.raises(ValueError, match="reward.workers"):
        ProcessRewardService(RewardSpec("math"), workers=0)
