"""A step's batch: built from scored groups, or ahead of time while the trainer trains.

Contract: ``prepare(c, items, need)`` turns ``(index, group)`` items into
``(groups, batch, stats, extra)`` (groups in admission order; ``extra`` holds
the trainer passes ``need`` asks for). ``train_and_prepare_next(c, batch,
loss_fn, need, version=None)`` trains on ``batch`` (with ``version``, through
``trainer.train_and_publish``, which publishes the new weights as that version
as the step ends) and returns ``(trained, ahead)``: ``trained`` is what the
trainer call returned;
``ahead`` is the next step's ``prepare`` result when its groups were already
buffered and preparing them needs no trainer call, else None. ``c`` is the
loop's bundle (``cfg``, ``trainer``, ``buffer``).
"""
from __future__ import annotations

import threading

from conveyor import objective


def prepare(c, items, need: objective.Needs):
    """Scored groups (in admission order) -> (groups, batch, stats, trainer extras)."""
    groups = [g for _, g in sorted(items, key=lambda x: x[0])]
    base = objective.base_batch([t for g in groups for t in g.trajectories])
    extra = {}
    if need.proximal:
        extra["proximal_logprobs"] = c.trainer.logprobs(base)
    if need.reference:
        extra["ref_logprobs"] = c.trainer.ref_logprobs(base)
    if need.values:
        extra["values"] = c.trainer.values(base)
    batch, stats = objective.make_batch(groups, c.cfg.algo, extra, base)
    return groups, batch, stats, extra


def train_and_prepare_next(c, batch, loss_fn, need: objective.Needs, version: int | None = None):
    """Train on ``batch``. Meanwhile, when the next step's groups are already buffered (the
    trainer is the slower role) and preparing them asks nothing of the trainer, prepare them
    too: batch building then stays off the trainer's critical path. The groups are the ones
    the next step would take anyway (the admission rule fixes their staleness), so nothing
    but timing changes; with max_staleness 0 they are never buffered yet."""
    n = c.cfg.loop.batch_size

    def train():
        if version is None:
            return c.trainer.train(batch, loss_fn)
        return c.trainer.train_and_publish(batch, loss_fn, version)
    if need.proximal or need.reference or need.values or len(c.buffer) < n:
        return train(), None
    result: dict = {}

    def build() -> None:
        try:
            result["ahead"] = prepare(c, c.buffer.get(n, timeout=c.cfg.launch.timeout_s), need)
        except BaseException as e:  # noqa: BLE001 - raised below, after training
            result["error"] = e

    worker = threading.Thread(target=build, name="prepare-next", daemon=True)
    worker.start()
    try:
        trained = train()
    finally:
        worker.join(c.cfg.launch.timeout_s)
    if "error" in result:
        raise result["error"]
    return trained, result.get("ahead")
