"""What a launcher provides to the controller: the role handles, started where it decides.

Contract: a ``Launcher`` is built for one run (``cfg``, ``run_dir``): ``start_engines`` returns
``Engines`` (the ``EngineWorker`` handles, their outbox, the context limit, the warm-start
route and the restart budget), ``start_trainer`` a ``TrainerHandle`` (``trainer/api.py``),
stopping at once when another role fails meanwhile.
Implementations: ``launch.local.LocalLauncher`` (in-process threads or local
processes, by ``launch.placement``) and ``launch.ray.RayLauncher`` (Ray
actors, ``launch.backend=ray``).

This module holds only the protocol: it starts nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from conveyor.rollout.api import EngineWorker
from conveyor.rollout.restarts import EngineRestarts
from conveyor.trainer.api import Trainer, TrainerHandle


@dataclass(frozen=True)
class Engines:
    workers: list[EngineWorker]
    outbox: Any
    context_limit: int
    label: str  # what generates (the first engine's description), logged when the run starts
    warm: Any  # has publish(named_tensors, version); None without a warm-start route
    restarts: EngineRestarts = field(default_factory=lambda: EngineRestarts(0))


@runtime_checkable
class Launcher(Protocol):
    """Contract: a ``Launcher`` is built for one run (``cfg``, ``run_dir``).
    ``start_engines(path, tokenizer)`` starts the engine workers on the weights
    at ``path`` and returns ``Engines``: the ``EngineWorker`` handles
    (``rollout/api.py``), the outbox their answers arrive on
    (``transport.messages``), the context limit every prompt must fit,
    ``warm``: where the controller publishes warm-start weights (every engine
    reads it; None when nothing can be published from the controller), and
    ``restarts``: the run's engine restart budget (``launch.max_restarts``,
    ``rollout.restarts.EngineRestarts``), of which the start spent what engines
    that died while starting took; the producer spends the rest.
    ``start_trainer(path, tokenizer, failed)`` starts the trainer ranks and returns a
    ``TrainerHandle`` (``trainer/api.py``); while it waits for them it asks
    ``failed()`` for another role's error (an engine that died meanwhile) and
    stops with it at once (``procs.stop_for``). ``warm_start_trainer(cfg, path,
    tokenizer)`` builds a plain ``Trainer`` in this process (the supervised
    warm start). ``stop_engines(workers)`` stops what ``start_engines`` started.
    ``trainer_gpus_alone()`` says, once the engines are started, whether every trainer rank has a
    GPU that no engine uses (the trainer's micro-batches may then take more of its memory).
    """
    def start_engines(self, path: str, tokenizer: Any) -> Engines: ...

    def start_trainer(self, path: str, tokenizer: Any,
                      failed: Callable[[], BaseException | None] = lambda: None) -> TrainerHandle: ...

    def warm_start_trainer(self, cfg: Any, path: str, tokenizer: Any) -> Trainer: ...

    def stop_engines(self, workers: list[EngineWorker]) -> None: ...

    def trainer_gpus_alone(self) -> bool: ...
