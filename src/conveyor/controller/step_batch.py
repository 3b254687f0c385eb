"""A step's batch: built from scored groups, or ahead of time while the trainer trains.

Contract: ``prepare(trainer, algo, items, need)`` turns ``Scored`` items into
a ``StepBatch``: the groups in admission order with their places in the
schedule (``indices``), the trainer's batch, its stats, and ``extra``, the
trainer passes ``need`` asks for. ``train_and_prepare_next(trainer,
buffer, loop, batch, loss_fn, need, version, last, algo)`` trains on
``batch`` through ``trainer.train_and_publish`` (the new weights leave as
``version`` as the step ends) and returns ``(trained, ahead)``: ``trained``
is what that call returned (its spans go to the run's timeline); ``ahead``
is a ``Prefetch`` building the next step's batch on a thread, or None where
the loop builds it itself: on the
last step, when preparing needs a trainer call, or with ``max_staleness`` 0
and the groups not yet buffered (they cannot arrive before the new version
is published). ``Prefetch.take(timeout)`` returns the ``StepBatch``
once it is built, or raises what building it raised. With a ``replay``
store (``controller/replay.py``) the batch also holds the replayed groups the
store gives the step (``prepare``'s ``step``); the groups returned stay the
fresh ones, and the stats gain the replay metrics. It knows nothing of
engines, rewards or where the trainer runs.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from conveyor.config import AlgoConfig, LoopConfig
from conveyor.controller import objective
from conveyor.controller.replay import ReplayStore
from conveyor.observe import timeline
from conveyor.observe.timers import PhaseTimer
from conveyor.trainer.api import LossFn, TrainerSteps
from conveyor.transport.buffer import TrajectoryBuffer
from conveyor.transport.messages import Scored, Trained
from conveyor.types import Batch, Group


@dataclass(frozen=True)
class StepBatch:
    """A step's fresh groups in admission order and their places in the schedule, the batch
    the trainer trains (replayed groups included), its stats and the trainer's extras."""
    groups: list[Group]
    indices: tuple[int, ...]
    batch: Batch
    stats: dict
    extra: dict


def prepare(trainer: TrainerSteps, algo: AlgoConfig, items: list[Scored], need: objective.Needs,
            replay: ReplayStore | None = None, step: int = 0) -> StepBatch:
    """Scored groups -> the step's ``StepBatch`` (groups in admission order)."""
    items = sorted(items, key=lambda s: s.index)
    groups = [s.group for s in items]
    mix = replay.mix(groups, step) if replay is not None else None
    trained = mix.groups if mix is not None else groups  # fresh, then replayed
    base = objective.base_batch([t for g in trained for t in g.trajectories])
    extra = {}
    if need.proximal:
        extra["proximal_logprobs"] = trainer.logprobs(base)
    if need.reference:
        extra["ref_logprobs"] = trainer.ref_logprobs(base)
    if need.values:
        extra["values"] = trainer.values(base)
    batch, stats = objective.make_batch(trained, algo, extra, base)
    if mix is not None:
        stats.update(mix.metrics())
    return StepBatch(groups, tuple(s.index for s in items), batch, stats, extra)


class Prefetch:
    """The next step's batch, built on a thread: it waits for the groups (with the run's
    deadline) and prepares them as soon as they are all scored, so what arrives while the
    trainer trains costs the trainer nothing. The buffer is FIFO, so these are the groups the
    next step would take anyway: only timing changes."""

    def __init__(self, trainer: TrainerSteps, buffer: TrajectoryBuffer, algo: AlgoConfig, batch_size: int,
                 need: objective.Needs, timeout_s: float, replay: ReplayStore | None = None, step: int = 0):
        self._out = {}
        self._thread = threading.Thread(target=self._build, args=(trainer, buffer, algo, batch_size, need, timeout_s,
                                                                  replay, step), name="prepare-next", daemon=True)
        self._thread.start()

    def _build(self, trainer, buffer, algo, batch_size, need, timeout_s, replay, step) -> None:
        try:
            self._out["ahead"] = prepare(trainer, algo, buffer.get(batch_size, timeout=timeout_s), need, replay, step)
        except BaseException as e:  # noqa: BLE001 - raised by take(), in the loop's thread
            self._out["error"] = e

    def take(self, timeout: float) -> StepBatch:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the next batch was not ready within {timeout:g}s (launch.timeout_s); "
                               "generation or scoring is stalled")
        if "error" in self._out:
            raise self._out["error"]
        return self._out["ahead"]


def train_and_prepare_next(trainer: TrainerSteps, buffer: TrajectoryBuffer, loop: LoopConfig, algo: AlgoConfig,
                           batch, loss_fn: LossFn, need: objective.Needs, version: int, timeout_s: float,
                           timer: PhaseTimer, last: bool = False, replay: ReplayStore | None = None,
                           memory=None) -> tuple[Trained, Prefetch | None]:
    """Train on ``batch`` (phase ``train``); meanwhile build the next step's batch (``Prefetch``) when
    that asks nothing of the trainer and its groups can arrive during training (the next step is
    ``version``). ``memory`` (launch.time_share): the engines' KV pools, released first (phase
    ``release``): the step's generation is over."""
    if memory is not None:
        with timer.phase("release"):
            memory.release()
    ahead = None
    can_arrive = loop.max_staleness > 0 or len(buffer) >= loop.batch_size
    if not (last or need.proximal or need.reference or need.values) and can_arrive:
        ahead = Prefetch(trainer, buffer, algo, loop.batch_size, need, timeout_s, replay, step=version)
    with timer.phase("train"):
        trained = trainer.train_and_publish(batch, loss_fn, version)
    timeline.record_spans("trainer", trained.spans)  # every rank's train and publish, for the timeline
    return trained, ahead
