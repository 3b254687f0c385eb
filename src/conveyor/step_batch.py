"""A step's batch: built from scored groups, or ahead of time while the trainer trains.

Contract: ``prepare(c, items, need)`` turns ``(index, group)`` items into
``(groups, batch, stats, extra)`` (groups in admission order; ``extra`` holds
the trainer passes ``need`` asks for). ``train_and_prepare_next(c, batch,
loss_fn, need, version=None, last=False)`` trains on ``batch`` (with
``version``, through ``trainer.train_and_publish``, which publishes the new
weights as that version as the step ends) and returns ``(trained, ahead)``:
``trained`` is what the trainer call returned; ``ahead`` is a ``Prefetch``
building the next step's batch on a thread, or None where the loop builds it
itself: on the last step, when preparing needs a trainer call, or with
``max_staleness`` 0 and the groups not yet buffered (they cannot arrive
before the new version is published). ``Prefetch.take(timeout)`` returns the
``prepare`` result once it is built, or raises what building it raised.
``c`` is the loop's bundle (``cfg``, ``trainer``, ``buffer``).
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


class Prefetch:
    """The next step's batch, built on a thread: it waits for the groups (with the run's
    deadline) and prepares them as soon as they are all scored, so what arrives while the
    trainer trains costs the trainer nothing. The buffer is FIFO, so these are the groups the
    next step would take anyway: only timing changes."""

    def __init__(self, c, need: objective.Needs):
        self._c, self._need, self._out = c, need, {}
        self._thread = threading.Thread(target=self._build, name="prepare-next", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        c = self._c
        try:
            self._out["ahead"] = prepare(c, c.buffer.get(c.cfg.loop.batch_size, timeout=c.cfg.launch.timeout_s),
                                         self._need)
        except BaseException as e:  # noqa: BLE001 - raised by take(), in the loop's thread
            self._out["error"] = e

    def take(self, timeout: float):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the next batch was not ready within {timeout:.0f}s (launch.timeout_s); "
                               "generation or scoring is stalled")
        if "error" in self._out:
            raise self._out["error"]
        return self._out["ahead"]


def train_and_prepare_next(c, batch, loss_fn, need: objective.Needs, version: int | None = None,
                           last: bool = False):
    """Train on ``batch``; meanwhile build the next step's batch (``Prefetch``) when that asks
    nothing of the trainer and its groups can arrive during training."""
    ahead = None
    can_arrive = c.cfg.loop.max_staleness > 0 or len(c.buffer) >= c.cfg.loop.batch_size
    if not (last or need.proximal or need.reference or need.values) and can_arrive:
        ahead = Prefetch(c, need)
    if version is None:
        return c.trainer.train(batch, loss_fn), ahead
    return c.trainer.train_and_publish(batch, loss_fn, version), ahead
