"""Engines that die while starting are restarted from the run's one budget (``launch.max_restarts``),
the one the producer spends mid-run; an engine that cannot be built stops the start at once.

The workers are stand-ins with the ``EngineWorker`` calls: a "process" that is dead until its
restart count reaches a number, and that reports ``Ready`` once alive.
"""
from __future__ import annotations

import queue

import pytest

from conveyor.launch.roles import await_ready
from conveyor.rollout.restarts import EngineRestarts
from conveyor.runtime.errors import RoleError
from conveyor.transport.messages import Failed, Ready


class Worker:
    """Dead for its first ``deaths`` starts; each start that lives reports Ready on ``outbox``."""

    restartable = True

    def __init__(self, engine_id: int, outbox: queue.Queue, deaths: int = 0, fails: bool = False):
        self.engine_id, self.outbox, self.deaths, self.fails = engine_id, outbox, deaths, fails
        self.restarts = 0
        self._started()

    def _started(self) -> None:
        if self.fails:
            self.outbox.put(Failed(self.engine_id, "Traceback ...\nOSError: no such checkpoint"))
        elif self.restarts >= self.deaths:
            self.outbox.put(Ready(self.engine_id, 64, "stand-in engine"))

    def check(self) -> None:
        if self.restarts < self.deaths:
            raise RoleError(f"engine{self.engine_id} process exited with code -9; last lines of its log:\n...")

    def restart(self) -> None:
        self.restarts += 1
        self._started()

    def send(self, message) -> None:
        pass

    def join(self, timeout: float) -> None:
        pass


def test_an_engine_killed_while_starting_is_restarted_and_counted(caplog):
    outbox: queue.Queue = queue.Queue()
    workers = [Worker(0, outbox), Worker(1, outbox, deaths=2)]
    budget = EngineRestarts(3)
    assert await_ready(workers, outbox, 30.0, budget) == (64, "stand-in engine")
    assert workers[1].restarts == 2 and workers[0].restarts == 0
    assert budget.used == 2  # what the producer is handed: it has 1 restart left
    lines = [r.getMessage() for r in caplog.records]
    assert [line.startswith("engine1 process exited with code -9") for line in lines] == [True, True], lines
    assert lines[-1].endswith("restarting it (2 of launch.max_restarts=3) while the engines start"), lines


def test_past_the_budget_a_death_while_starting_stops_naming_the_engine():
    outbox: queue.Queue = queue.Queue()
    workers = [Worker(0, outbox, deaths=5)]
    budget = EngineRestarts(1)
    with pytest.raises(RoleError) as err:
        await_ready(workers, outbox, 30.0, budget)
    text = str(err.value)
    assert text.startswith("engine0 process exited with code -9")
    assert "engine restarts used: 1 of launch.max_restarts=1" in text
    assert workers[0].restarts == 1 and budget.used == 1


def test_an_engine_that_cannot_be_built_is_not_restarted():
    outbox: queue.Queue = queue.Queue()
    workers = [Worker(0, outbox, fails=True)]
    budget = EngineRestarts(3)
    with pytest.raises(RoleError) as err:
        await_ready(workers, outbox, 30.0, budget)
    assert str(err.value).startswith("engine 0 failed while starting:") and "no such checkpoint" in str(err.value)
    assert workers[0].restarts == 0 and budget.used == 0


def test_a_weight_failure_while_starting_is_restarted_like_a_death():
    outbox: queue.Queue = queue.Queue()
    worker = Worker(0, outbox)
    outbox.queue.clear()  # its first start reports its weights failed instead of Ready
    outbox.put(Failed(0, "Traceback ...\nWeightSyncError: receive broke", weights=True))
    budget = EngineRestarts(1)
    await_ready([worker], outbox, 30.0, budget)
    assert worker.restarts == 1 and budget.used == 1
