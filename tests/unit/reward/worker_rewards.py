"""Rewards that the process-executor tests load by name in worker processes (a worker imports
them fresh, so they live in a module of their own, importable from the repository root)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from conveyor.types import Trajectory


def length(traj: Trajectory, sleep_s: float = 0.0, stamps: bool = False) -> dict:
    """The text's length, and which process scored it (after ``sleep_s``); with ``stamps``, also
    when the call ``started`` and ``ended`` (wall clock)."""
    started = time.time()
    time.sleep(sleep_s)
    out = {"reward": float(len(traj.text)), "pid": os.getpid()}
    if stamps:
        out.update(started=started, ended=time.time())
    return out


def held(traj: Trajectory, allow_file: str = "", prefix: str = "") -> float:
    """The text's length over 10. While ``allow_file`` exists, a trajectory of a task whose id
    starts with ``prefix`` and is not listed there (one id a line) is held unscored: a test
    decides this way which groups a run can train."""
    path = Path(allow_file) if allow_file else None
    while (path is not None and traj.task.id.startswith(prefix) and path.exists()
           and traj.task.id not in path.read_text().split()):
        time.sleep(0.05)
    return len(traj.text) / 10


def hang_on(traj: Trajectory, word: str = "hang", pidfile: str = "") -> float:
    """Sleeps for good on a text containing ``word`` (writing its pid to ``pidfile`` first); 1.0
    otherwise."""
    if word in traj.text and pidfile:
        Path(pidfile).write_text(str(os.getpid()))
    while word in traj.text:
        time.sleep(0.05)
    return 1.0


def die_once(traj: Trajectory, marker: str, how: str = "exit", word: str = "die") -> float:
    """Ends its process on a text containing ``word`` the first time (``marker``, a file, records
    the dead pid), by ``os._exit`` (``how="exit"``) or by SIGKILL as the OOM killer would
    (``how="kill"``); otherwise returns its own pid."""
    if word in traj.text and not Path(marker).exists():
        Path(marker).write_text(str(os.getpid()))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    return float(os.getpid())


def kill_on(traj: Trajectory, word: str = "kill") -> float:
    """SIGKILLs its own process on a text containing ``word``, as the OOM killer would."""
    if word in traj.text:
        os.kill(os.getpid(), signal.SIGKILL)
    return 2.0


def returns(traj: Trajectory, value: object = 1.0) -> object:
    return value


def raises(traj: Trajectory) -> float:
    raise KeyError("boom")


def spin(traj: Trajectory, iterations: int = 200_000) -> float:
    """Pure-Python arithmetic holding the GIL: ``iterations`` rounds of a linear congruence."""
    x = len(traj.text) + 1
    for _ in range(iterations):
        x = (x * 1103515245 + 12345) % 2147483648
    return x / 2147483648


class Batched:
    """A ``BatchReward`` (scores lists of trajectories) that gives every trajectory 1.0."""
    name = "batched"
    max_batch = 4

    def score_batch(self, trajs):
        return [1.0 for _ in trajs]

    def close(self) -> None:
        pass


def flaky(traj: Trajectory, share: float = 0.1) -> float:
    """A verifier with seeded faults: on ``share`` of texts it hangs for good, on another ``share``
    it SIGKILLs its own process; otherwise the text's length over 10."""
    import hashlib
    u = int.from_bytes(hashlib.sha256(traj.text.encode()).digest()[:4], "big") / 2**32
    while u < share:
        time.sleep(0.05)
    if u < 2 * share:
        os.kill(os.getpid(), signal.SIGKILL)
    return len(traj.text) / 10


class SlowBatches:
    """A ``BatchReward`` whose calls can hang or kill their process: each trajectory gets its text's
    length, with the size of the batch it was scored in and the scoring pid. A batch holding a
    text with ``hang`` sleeps ``sleep_s`` first (past any deadline a test sets); one holding a text
    with ``die`` SIGKILLs its process, as the OOM killer would, the first ``dies`` times (``marker``,
    a file, records the dead pids, one a line)."""
    name = "slow-batches"

    def __init__(self, max_batch: int = 4, sleep_s: float = 60.0, marker: str = "", dies: int = 1) -> None:
        self.max_batch, self.sleep_s, self.marker, self.dies = max_batch, sleep_s, marker, dies

    def score_batch(self, trajs):
        if any("hang" in t.text for t in trajs):
            time.sleep(self.sleep_s)
        dead = Path(self.marker).read_text().split() if self.marker and Path(self.marker).exists() else []
        if self.marker and any("die" in t.text for t in trajs) and len(dead) < self.dies:
            Path(self.marker).write_text("\n".join([*dead, str(os.getpid())]))
            os.kill(os.getpid(), signal.SIGKILL)
        return [{"reward": float(len(t.text)), "batch": len(trajs), "pid": os.getpid()} for t in trajs]

    def close(self) -> None:
        pass
