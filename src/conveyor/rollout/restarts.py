"""The run's engine restart budget: one count for every engine death, however it was noticed.

Contract: ``EngineRestarts(limit)`` (``launch.max_restarts``) is made by the launcher with the
engines and spent by whoever notices a death (the launcher while the engines start, the
producer mid-run); past the budget a death is raised as a ``RoleError`` saying how much of
the budget was used. ``used`` is the ``engine_restarts`` metric.

It knows nothing of work in flight (the producer sends it again) or of how
workers start.
"""
from __future__ import annotations

import logging
import time

from conveyor.observe import timeline
from conveyor.rollout.api import EngineWorker
from conveyor.runtime.errors import RoleError

logger = logging.getLogger(__name__)


class EngineRestarts:
    """Contract: ``EngineRestarts(limit)`` (``launch.max_restarts``) is made by the
    launcher with the engines (``launch.api.Engines.restarts``) and spent by
    whoever notices a death: the launcher while the engines start
    (``launch.roles.await_ready``) and the producer mid-run. ``replace(worker,
    dead)`` restarts a dead ``EngineWorker`` (``rollout/api.py``) if it is
    restartable and the budget has room, counting it, logging
    ``<why>; restarting it (k of launch.max_restarts=N)`` and putting
    ``engine N restarted`` on the controller's ``restarts`` row of the
    timeline; otherwise it raises the death as a ``RoleError`` saying how much of
    the budget was used. ``used`` is the count so far (the ``engine_restarts``
    metric).
    """
    def __init__(self, limit: int):
        self.limit, self.used = int(limit), 0

    def can_restart(self, worker: EngineWorker) -> bool:
        return worker.restartable and self.used < self.limit

    def replace(self, worker: EngineWorker, dead: RoleError, doing: str = "") -> None:
        """Restart ``worker``, dead of ``dead``, or raise ``dead`` with the budget's state;
        ``doing`` ends the log line (what the caller does next)."""
        if not self.can_restart(worker):
            used = f" (engine restarts used: {self.used} of launch.max_restarts={self.limit})"
            raise RoleError(f"{dead}{used if worker.restartable else ''}") from None
        self.restart(worker, str(dead).splitlines()[0], doing)

    def restart(self, worker: EngineWorker, why: str, doing: str = "") -> None:
        """Restart ``worker`` for ``why`` and count it (the caller checked ``can_restart``)."""
        self.used += 1
        logger.warning("%s; restarting it (%d of launch.max_restarts=%d)%s", why, self.used, self.limit, doing)
        now = time.time()
        timeline.record("controller", "restarts", f"engine {worker.engine_id} restarted", now, now, {"why": why})
        worker.restart()
