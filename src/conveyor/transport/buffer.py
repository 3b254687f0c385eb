"""The trajectory buffer between the producers (engines + rewards) and the trainer.

Contract: ``TrajectoryBuffer(capacity)`` holds scored ``Group`` objects, whole
(a group enters only when all n of its samples are scored, so there are no
partial groups in the buffer: the documented choice is that a group is
trained complete or not at all). ``put`` blocks while the buffer is full
(back-pressure on the producers) and ``get(k)`` blocks until k groups are
there; both take a deadline and raise ``BufferTimeout`` naming what was
awaited and for how long. ``close(error)`` wakes every waiter; a closed
buffer re-raises the error that closed it, so a dead producer stops the
trainer instead of leaving it waiting. Groups leave in arrival order (FIFO),
which with bounded staleness keeps the oldest data first.

It knows nothing of engines, versions or the admission rule.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from conveyor.types import Group


class BufferTimeout(TimeoutError):
    pass


class BufferClosed(RuntimeError):
    pass


class TrajectoryBuffer:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"TrajectoryBuffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: deque[Group] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self.put_wait_s = 0.0  # time producers spent blocked on a full buffer
        self.get_wait_s = 0.0  # time the trainer spent waiting for data

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def _check_closed(self) -> None:
        if self._closed:
            if self._error is not None:
                raise BufferClosed(f"trajectory buffer closed: {self._error}") from self._error
            raise BufferClosed("trajectory buffer closed")

    def put(self, group: Group, timeout: float) -> None:
        t0 = time.perf_counter()
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity, timeout)
            self.put_wait_s += time.perf_counter() - t0
            self._check_closed()
            if not ok:
                raise BufferTimeout(f"trajectory buffer stayed full ({self.capacity} groups) for {timeout:g}s; "
                                    "the trainer is not consuming")
            self._items.append(group)
            self._cond.notify_all()

    def get(self, k: int, timeout: float) -> list[Group]:
        if k > self.capacity:
            raise ValueError(f"cannot take {k} groups from a buffer of capacity {self.capacity}")
        t0 = time.perf_counter()
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or len(self._items) >= k, timeout)
            self.get_wait_s += time.perf_counter() - t0
            self._check_closed()
            if not ok:
                raise BufferTimeout(f"waited {timeout:g}s for {k} scored groups, have {len(self._items)}; "
                                    "generation or scoring is stalled")
            out = [self._items.popleft() for _ in range(k)]
            self._cond.notify_all()
            return out

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            if not self._closed:
                self._closed, self._error = True, error
            self._cond.notify_all()
