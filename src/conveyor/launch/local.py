"""The local launcher: every role on this machine, in this process or in child processes.

Contract: a ``LocalLauncher`` (``run.local.run_local`` runs a run with one)
provides the ``launch.api.Launcher`` calls:
it plans the placement (``placement.plan``; one that does not fit the
visible GPUs is a ``SetupError``), allocates the weight routes once
(``placement.make_routes``) and starts the engine workers and the trainer
through ``roles`` — an engine thread and an in-process ``TrainerHost`` for
colocated N = M = 1, child processes otherwise. It knows nothing of the loop,
the schedule or the formulas.
"""
from __future__ import annotations

from pathlib import Path

from conveyor.config import RunConfig
from conveyor.launch import placement, roles
from conveyor.launch.api import Engines
from conveyor.rollout.restarts import EngineRestarts
from conveyor.runtime.errors import SetupError
from conveyor.trainer.api import TrainerHandle

__all__ = ["LocalLauncher", "SetupError"]


class LocalLauncher:
    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.placement: placement.Placement | None = None
        self.routes: placement.Routes | None = None

    def start_engines(self, path: str, tokenizer) -> Engines:
        try:
            self.placement = placement.plan(self.cfg)
        except placement.PlacementError as e:
            raise SetupError(str(e)) from None
        self.routes = placement.make_routes(self.cfg, self.placement, path, roles.mp_context())
        restarts = EngineRestarts(self.cfg.launch.max_restarts)
        workers, outbox, context_limit, label = roles.start_engines(self.cfg, path, tokenizer, self.routes,
                                                                    self.placement, self.run_dir, restarts)
        return Engines(workers, outbox, context_limit, label, self.routes.controller, restarts)

    def trainer_gpus_alone(self) -> bool:
        return self.placement is not None and self.placement.trainer_alone

    def start_trainer(self, path: str, tokenizer, failed=lambda: None) -> TrainerHandle:
        return roles.start_trainer(self.cfg, path, tokenizer, self.routes, self.placement, self.run_dir, failed)

    def warm_start_trainer(self, cfg: RunConfig, path: str, tokenizer):
        beside = self.placement is not None and self.placement.sync != "inprocess" and not self.placement.gpu
        return roles.make_warm_trainer(cfg, path, tokenizer, beside_engines=beside)

    def stop_engines(self, workers) -> None:
        roles.stop_engines(workers)
