"""Colocated memory time sharing (``launch.time_share``): the engines' KV pools, switched by the loop.

Contract: ``TimeShare(workers, timeout_s, failed)`` is the loop's ``EngineMemory``
(``controller/accumulate.py``). ``release()`` sends every engine worker ``Memory(hold=False)``
and returns once each answered ``MemoryDone`` (the pool's memory is free for the trainer);
``reacquire()`` sends ``Memory(hold=True)`` and waits the same way, so the next step's chunks
find the pool held. The producer's collector passes each ``MemoryDone`` to ``acknowledge``.
A switch not answered within ``timeout_s``, or a producer that failed meanwhile (``failed()``
returns its error), raises ``RoleError`` naming the engines that did not answer. The loop calls
these only between a synchronous step's generation and the next, when the engines run nothing.
``seconds`` holds the slowest engine's own time of the last switch.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from conveyor.rollout.api import EngineWorker
from conveyor.runtime.errors import RoleError
from conveyor.transport.messages import Memory, MemoryDone


class TimeShare:
    def __init__(self, workers: tuple[EngineWorker, ...], timeout_s: float,
                 failed: Callable[[], BaseException | None]):
        self.workers, self.timeout_s, self._failed = workers, timeout_s, failed
        self._cond = threading.Condition()
        self._answered: dict[int, float] = {}
        self._hold: bool | None = None
        self.seconds = 0.0

    def release(self) -> None:
        self._switch(False)

    def reacquire(self) -> None:
        self._switch(True)

    def acknowledge(self, msg: MemoryDone) -> None:
        with self._cond:
            if msg.hold == self._hold:
                self._answered[msg.engine_id] = msg.seconds
                self._cond.notify_all()

    def _switch(self, hold: bool) -> None:
        with self._cond:
            self._hold, self._answered = hold, {}
        for w in self.workers:
            w.send(Memory(hold))
        with self._cond:
            done = self._cond.wait_for(lambda: len(self._answered) == len(self.workers) or self._failed(),
                                       self.timeout_s)
            missing = sorted(w.engine_id for w in self.workers if w.engine_id not in self._answered)
            self.seconds = max(self._answered.values(), default=0.0)
        error = self._failed()
        if error is not None:
            raise RoleError(f"the rollouts failed while the engines switched their KV pools: {error}") from error
        if not done:
            what = "take back" if hold else "release"
            raise RoleError(f"engines {missing} did not {what} their KV pool within {self.timeout_s:g}s "
                            "(launch.time_share); their stacks are in the run's log")
