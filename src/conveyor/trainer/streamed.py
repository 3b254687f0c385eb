"""A train call's last optimizer step, run group by group while its weights leave.

- ``StreamPlan(named, copies, params)`` cuts the publish list into groups of about
  ``STREAM_BYTES``; every parameter lands in exactly one group and every copy is refreshed after
  its master has stepped.
- ``plan.run(optimizer, publish)``: the publisher sends bucket k while the optimizer updates
  bucket k + 1, so the transfer ends about one bucket after the optimizer does.
- AdamW and SGD update each tensor from its own state only, so stepping the
  groups in turn gives the same bits as one ``optimizer.step()`` (tested).

It knows nothing of transports, versions or engines.
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from conveyor.transport.weights import copy_pairs

STREAM_BYTES = 64 * 2**20  # per group: small enough that the last one's bucket follows quickly


def step_subset(optimizer: torch.optim.Optimizer, ids: set[int]) -> None:
    """``optimizer.step()`` on the parameters whose ``id`` is in ``ids`` only."""
    saved = optimizer.param_groups
    optimizer.param_groups = [dict(g, params=[p for p in g["params"] if id(p) in ids]) for g in saved]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = saved  # hyperparameters and scheduler state live in the originals


class StreamPlan:
    """The last optimizer step of a train call, cut into groups that step as the weights leave.

    - ``StreamPlan(named, copies, params)``: ``named`` is the publish list ((name,
      tensor) in the order a transport's buckets are laid out), ``copies`` the
      (compute copy, master) pairs refreshed after a step, ``params`` every tensor
      the optimizer steps. It cuts the list into consecutive groups of about
      ``STREAM_BYTES`` published bytes and records, per group, the masters to
      step and the copies to refresh. Every parameter lands in exactly one group
      (one that publishes nothing joins the first) and every copy is refreshed
      after its master has stepped.
    - ``plan.run(optimizer, publish)`` calls ``publish(plan.steps(optimizer))``
      and steps whatever a failing publish left, returning its error (or None).
      ``plan.steps(optimizer)`` is a generator: each ``next`` steps one group's
      masters, refreshes its copies and yields its (name, tensor) pairs. A
      publisher that consumes it (``publish_all``) casts and sends bucket k while
      the optimizer updates the tensors of bucket k + 1, so the transfer ends
      about one bucket after the optimizer does instead of a whole transfer
      after it. ``plan.ended()`` is when the last group's optimizer work was done
      (on a GPU read off its clock: the host is usually still queueing sends).
    - AdamW and SGD update each tensor from its own state only, so stepping the
      groups in turn gives the same bits as one ``optimizer.step()`` (tested).
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], copies: list[tuple[torch.Tensor, torch.Tensor]],
                 params: list[torch.Tensor]):
        # A published tensor is a master, a compute copy or a buffer; state_dict() returns
        # detached views, so tensors are matched by address, not identity.
        by_ptr = {p.data_ptr(): p for p in params}
        copy_of = {c.data_ptr(): (c, m) for c, m in copies}
        self.groups: list[tuple[set[int], list, list]] = []  # (master ids, copy pairs, named)
        placed: set[int] = set()  # ids of masters and copies given a group
        size = STREAM_BYTES  # start a new group at the first tensor
        for name, t in named:
            if size >= STREAM_BYTES:
                self.groups.append((set(), [], []))
                size = 0
            ids, pairs, group = self.groups[-1]
            pair = copy_of.get(t.data_ptr())
            if pair is not None and id(pair[0]) not in placed:
                pairs.append(pair)
                placed.add(id(pair[0]))
            master = pair[1] if pair is not None else by_ptr.get(t.data_ptr())
            if master is not None and id(master) not in placed:
                ids.add(id(master))
                placed.add(id(master))
            group.append((name, t))
            size += t.numel() * t.element_size()
        if not self.groups:
            self.groups.append((set(), [], []))
        # Masters no published tensor names (none in a plain model) step with the first group;
        # copies not published (float32 publishes of a bf16 compute copy) refresh after the
        # last group, when every master has stepped.
        self.groups[0][0].update(id(p) for p in params if id(p) not in placed)
        self.groups[-1][1].extend((c, m) for c, m in copies if id(c) not in placed)
        self.cuda = any(p.device.type == "cuda" for p in params)
        self._anchor = self._stepped = None
        self._ended = 0.0

    def run(self, optimizer: torch.optim.Optimizer, publish) -> Exception | None:
        """``publish(self.steps(optimizer))``, then the groups it did not consume: a publish that
        fails still leaves a whole optimizer step. Returns the publish's error, if any."""
        steps = self.steps(optimizer)
        error = None
        try:
            publish(steps)
        except Exception as e:  # noqa: BLE001 - the caller raises it once its step is whole
            error = e
        for _ in steps:
            pass
        return error

    def ended(self) -> float:
        """``time.time()`` when the last group's optimizer work was done on the device. The host
        may reach this call much later (it queued the publish meanwhile): the time is read off
        the GPU's clock, from an event at the start of the step whose host time is known."""
        if not self.cuda:
            return self._ended
        anchor, t0 = self._anchor
        self._stepped.synchronize()
        return t0 + anchor.elapsed_time(self._stepped) / 1e3

    def steps(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
        if self.cuda:
            # The GPU is idle here (the gradient clipping read its norm on the host), so the
            # anchor runs at once; the host time before it is, if anything, early (a longer sync).
            t0, anchor = time.time(), torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            self._anchor = (anchor, t0)
        for k, (ids, pairs, named) in enumerate(self.groups):
            step_subset(optimizer, ids)
            copy_pairs(pairs)
            if k == len(self.groups) - 1:  # the step ends here, before the last bucket's copies
                if self.cuda:
                    self._stepped = torch.cuda.Event(enable_timing=True)
                    self._stepped.record()
                else:
                    self._ended = time.time()
            yield from named
