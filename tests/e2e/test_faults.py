"""Fault injection on whole runs: each fault is survived and counted, or stops the run naming the role.

Engine processes are restarted (their work in flight sent again; a weight broadcast group
re-forms around the replacement); a trainer rank that dies or an engine past the restart
budget stop the run with a named error
(tests/e2e/test_role_failure.py); reward and environment faults are counted by their
services (tests/unit/reward, tests/e2e/test_env_faults.py).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.observe.timeline import read_timeline

pytestmark = pytest.mark.slow  # whole training runs

TINY = ["sft.steps=0", "loop.batch_size=4", "rollout.n=4", "data.eval_size=8", "model.tiny.hidden_size=32",
        "model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "observe.tensorboard=false",
        "observe.progress=false", "launch.placement=disaggregated", "launch.timeout_s=120"]


ROOT = Path(__file__).resolve().parents[2]  # reward workers import tests.unit.reward.worker_rewards from here
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run_dir}", *TINY, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)


def train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "train"]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in train_rows(run_dir)):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def role_pids(run_dir: Path, role: str) -> list[int]:
    text = (run_dir / "logs" / f"{role}.log").read_text()
    return [int(p) for p in re.findall(rf"\[{role}\] started pid=(\d+)", text)]


@pytest.mark.parametrize("engine, extra", [
    (0, ()),  # weights by shared memory
    # Weights by a gloo broadcast group: it re-forms around the replacement, and the other
    # engine (a member that survives) serves on.
    (1, ("launch.weight_sync=broadcast", "launch.engines=2")),
])
def test_killed_engine_is_restarted_and_the_run_completes(tmp_path, engine, extra):
    run_dir = tmp_path / "run"
    # Streaming (staleness 1): the engine always has chunks in flight when it is killed, and
    # most of the run's steps are still to come (a tiny step takes a fraction of a second).
    proc = start(run_dir, "loop.steps=40", "loop.max_staleness=1", *extra)
    wait_for_step(proc, run_dir, 2)
    first = role_pids(run_dir, f"engine{engine}")[-1]
    os.kill(first, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))  # every step once: nothing lost or doubled
    assert rows[-1]["engine_restarts"] == 1, [r["engine_restarts"] for r in rows]
    pids = role_pids(run_dir, f"engine{engine}")
    assert len(pids) == 2 and pids[0] == first and pids[1] != first
    assert "restarting it (1 of launch.max_restarts=3)" in err
    events = [e for e in read_timeline(run_dir) if e.get("name") == f"engine {engine} restarted"]
    assert len(events) == 1, "the restart is on the timeline"
    if "launch.weight_sync=broadcast" in extra:
        log = (run_dir / "logs" / "trainer.log").read_text()
        assert "group re-formed as generation 1 with 2 engine(s); version" in log, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40


def test_engine_killed_while_starting_is_restarted_from_the_same_budget(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "loop.steps=20", "loop.max_staleness=1")
    deadline = time.monotonic() + 240
    while not (run_dir / "logs" / "engine0.log").exists() or not role_pids(run_dir, "engine0"):
        assert time.monotonic() < deadline and proc.poll() is None, "engine0 never started"
        time.sleep(0.01)
    # Killed as soon as its process runs: building the engine (transformers' imports, the
    # model) takes the next second or more, so it has not reported ready.
    os.kill(role_pids(run_dir, "engine0")[0], signal.SIGKILL)
    wait_for_step(proc, run_dir, 2)
    os.kill(role_pids(run_dir, "engine0")[-1], signal.SIGKILL)  # mid-run: its standby takes over
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "restarting it (1 of launch.max_restarts=3) while the engines start" in err, err[-3000:]
    assert "restarting it (2 of launch.max_restarts=3) and sending it its work in flight" in err, err[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[0]["engine_restarts"] >= 1 and rows[-1]["engine_restarts"] == 2  # one count for both
    assert len(role_pids(run_dir, "engine0")) == 3
    log = (run_dir / "logs" / "engine0.log").read_text()
    assert log.count("taking over from its standby process") == 1, log[-3000:]
    events = [e for e in read_timeline(run_dir) if e.get("name") == "engine 0 restarted"]
    assert len(events) == 2


def test_engine_deaths_past_the_budget_stop_the_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "loop.steps=100000", "loop.max_staleness=1", "launch.max_restarts=1")
    wait_for_step(proc, run_dir, 1)
    os.kill(role_pids(run_dir, "engine0")[-1], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while len(role_pids(run_dir, "engine0")) < 2:  # the replacement started
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(1.0)
    os.kill(role_pids(run_dir, "engine0")[-1], signal.SIGKILL)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=110)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 100  # no-hang bound: seconds idle; the lines below say the death stopped it
    assert proc.returncode == 1
    assert "engine0 process exited with code -9" in err
    assert "engine restarts used: 1 of launch.max_restarts=1" in err, err[-3000:]


def descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (read from /proc)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def trained_places(run_dir: Path) -> dict[int, dict[int, str]]:
    """Step -> {place in the rollout schedule: task id} of the groups it trained (from the traces)."""
    out: dict[int, dict[int, str]] = {}
    for line in (run_dir / "traces.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["step"], {})[r["place"]] = r["task_id"]
    return dict(sorted(out.items()))


def test_streaming_run_killed_with_sigkill_resumes_as_one_run(tmp_path):
    """kill -9 of the controller mid-streaming: no role process outlives it; --resume trains every
    group once, none lost, although the run trained its groups out of the schedule's order (the
    checkpoint saved places of a later step as trained and an earlier one as owed), the staleness
    bound holds, and the logs and totals read as one run."""
    # The reward (tests.unit.reward.worker_rewards:held) holds every training group but those of the
    # schedule's places 0-15 (the first four steps' admissions), less place 1, until the
    # controller is killed: steps 1-3 can train (12 groups of the 15) and step 4 cannot, so the
    # kill lands after step 3 however the test process is scheduled; step 2 must train a group
    # of a later admission in place 1's stead. The reward's deadline is far past the kill.
    allow = tmp_path / "allowed_tasks"
    stream = ["loop.steps=6", "loop.max_staleness=2", "loop.checkpoint_every=2", "observe.traces_per_step=16",
              "loop.eval_every=0", "reward.fn=tests.unit.reward.worker_rewards:held", "reward.timeout_s=120",
              "reward.workers=64",  # held calls keep their threads: the allowed ones need others
              f"reward.kwargs={{allow_file: {allow}, prefix: reverse-train-}}"]  # held-out tasks are scored
    whole = tmp_path / "whole"
    proc = start(whole, *stream)
    assert proc.wait(timeout=300) == 0, proc.communicate()[1][-3000:]
    task_at = {place: task for places in trained_places(whole).values() for place, task in places.items()}
    assert set(range(16)) <= set(task_at), sorted(task_at)  # a run's groups are its schedule's places
    owed = task_at[1]
    allow.write_text("\n".join(task_at[p] for p in range(16) if p != 1))

    run_dir = tmp_path / "run"
    proc = start(run_dir, *stream)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "step_000002").exists() or len(train_rows(run_dir)) < 3:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    kids = descendants(proc.pid)
    assert any(alive(k) for k in kids), "the engine and trainer run in child processes"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    while any(alive(k) for k in kids) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)], "role processes outlived the killed controller"
    assert max(r["step"] for r in train_rows(run_dir)) == 3
    saved = int(sorted((run_dir / "checkpoints").glob("step_*"))[-1].name.split("_")[1])
    assert saved == 2
    before = trained_places(run_dir)
    schedule = json.loads((run_dir / "checkpoints" / "step_000002" / "extra.json").read_text())["schedule"]
    trained_by_2 = sorted(p for step in (1, 2) for p in before[step])
    # Place 1 is owed: the resume draws again from step 1's boundary and skips what was trained.
    assert 1 not in trained_by_2 and max(trained_by_2) >= 8
    assert schedule == {"boundary": 0, "batch_size": 4, "done": trained_by_2}

    allow.unlink()  # the resumed run scores every task
    r = subprocess.run([sys.executable, "-m", "conveyor.cli", "train", "--resume", str(run_dir)],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]  # metrics.jsonl: each step once
    assert all(row["staleness_max"] <= 2 for row in rows)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals if e.get("kind") == "eval"] == [0, 6]  # the initial eval once
    after = trained_places(run_dir)
    assert {step: after[step] for step in (1, 2)} == {step: before[step] for step in (1, 2)}
    places = [p for step in after.values() for p in step]
    assert len(places) == len(set(places)) == 24  # no group twice
    assert all(task_at.get(p, after_task) == after_task for step in after.values()
               for p, after_task in step.items())  # each place drew the same task as in the whole run
    # None lost: the owed place is trained after the resume (it is sent first, with 16 groups to
    # train and at most 12 in flight), and so is every place below the last one trained by step 2.
    assert 1 in places and set(range(max(trained_by_2))) <= set(places)
    assert owed in {t for step in after.values() for t in step.values()}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == saved and summary["steps"] == 6
    # The whole run's time: the part before the kill (up to its last step) and the resumed part.
    first_part = rows[1]["time"] - evals[0]["time"]
    assert summary["wall_seconds"] > first_part


def test_reward_workers_that_hang_or_die_are_counted_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run_dir}", *TINY, "loop.steps=3",
           "reward.executor=process", "reward.workers=2", "reward.timeout_s=2",
           "reward.fn=tests.unit.reward.worker_rewards:flaky"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    last = train_rows(run_dir)[-1]
    assert last["reward_timeouts"] >= 1 and last["reward_worker_deaths"] >= 1, last
    assert last["step"] == 3


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_ctrl_c_ends_the_step_in_progress_saves_it_and_the_run_resumes(tmp_path, placement):
    """Ctrl-C reaches the terminal's whole process group: the role processes ignore it, the step in
    progress ends whole and is checkpointed (although no checkpoint was due), the run exits 130,
    and --resume continues from that step as one run."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run_dir}", *TINY, "loop.steps=400",
           "loop.checkpoint_every=1000", "loop.eval_every=0", f"launch.placement={placement}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
                            start_new_session=True)
    wait_for_step(proc, run_dir, 2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    last = max(r["step"] for r in train_rows(run_dir))
    assert f"conveyor: interrupted: stopped after step {last}, saved in " in err, err[-3000:]
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == [f"step_{last:06d}"]
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err[-3000:]
    if placement == "colocated":  # one process
        return
    for log in (run_dir / "logs").glob("*.log"):
        assert "KeyboardInterrupt" not in log.read_text(), log
    r = subprocess.run([sys.executable, "-m", "conveyor.cli", "train", "--resume", str(run_dir),
                        f"loop.steps={last + 1}"], capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in train_rows(run_dir)] == list(range(1, last + 2))
