"""A step's gradient accumulated part by part, as the step's groups arrive.

- The weights do not change until the step ends, so each part of a step's batch runs forward
  and backward as soon as it exists; ``Accumulation.normalise`` divides the summed gradients by
  the whole batch's total once it is known. The result is ``train``'s gradient, up to the
  rounding of a different summation order.
- A loss function that declares no ``normaliser`` cannot be accumulated: ``begin`` refuses it.
- ``AccumulatingTrainer`` is the trainer side, a mixin of ``LocalTrainer``.

It knows nothing of where the parts come from or when the step is taken.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from conveyor.trainer.api import LossFn, loss_name
from conveyor.trainer.sm_share import SMShare
from conveyor.trainer.step_metrics import MetricMean

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.types import Batch


@dataclass
class Accumulation:
    """The parts taken so far: their totals, metrics and summed (unnormalised) losses.

    - With one optimizer step per batch the weights do not change until the step
      ends, so each part of a step's batch can run forward and backward as soon
      as it exists (``LocalTrainer.accumulate``), and the step is taken once the
      last part is in (``train_accumulated``). The parts' losses are computed
      with both denominators at 1 (``num_tokens = num_seqs = 1``: sums), and
      ``Accumulation.normalise`` divides the summed gradients, and the summed
      loss, by the whole batch's total once it is known: loss tokens when the loss
      function's ``needs.normaliser`` is ``"tokens"`` (token-mean), sequences when it is
      ``"seqs"`` (the sequence means, Dr. GRPO's constant length). The result is
      the gradient of the loss over the whole batch, as ``train`` computes it, up
      to the rounding of a different summation order.
    - A loss function that declares no ``normaliser`` (``LossNeeds``) cannot be accumulated
      this way (nothing says which total it divides by): ``begin`` refuses it by name.
    """
    normaliser: str
    lr: float
    start: float
    parts: int = 0
    num_tokens: int = 0
    num_seqs: int = 0
    means: MetricMean = field(default_factory=MetricMean)
    totals: dict = field(default_factory=lambda: {"loss": 0.0, "grad_norm": 0.0, "critic_grad_norm": 0.0,
                                                  "microbatches": 0})

    @classmethod
    def begin(cls, loss_fn: LossFn, lr: float) -> Accumulation:
        normaliser = loss_fn.needs.normaliser
        if normaliser is None:
            raise ValueError(f"accumulate: the loss function {loss_name(loss_fn)} declares no normaliser; give it "
                             "needs=LossNeeds(normaliser='tokens') (it divides by num_tokens) or 'seqs' (by "
                             "num_seqs), or train the whole batch at once")
        return cls(normaliser, lr, time.perf_counter())

    def add(self, part: Batch) -> None:
        self.parts += 1
        self.num_tokens += int(part.num_tokens)
        self.num_seqs += len(part)

    @property
    def denominator(self) -> float:
        return float(max(self.num_tokens if self.normaliser == "tokens" else self.num_seqs, 1))

    @torch.no_grad()
    def normalise(self, param_sets: Iterable[Iterable[torch.nn.Parameter]]) -> None:
        """Divide every accumulated gradient (and the summed loss) by the batch's total."""
        scale = 1.0 / self.denominator
        for params in param_sets:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.totals["loss"] *= scale


class AccumulatingTrainer:
    """``accumulate`` / ``train_accumulated`` for a single-device trainer (``LocalTrainer``).

    The host class provides: ``cfg`` (``TrainerConfig``), ``device``, ``model`` and ``compute``
    (master and compute modules), ``critic`` (or None), ``optimizer``, ``_acc`` (an
    ``Accumulation`` or None) and ``_sm_share`` (an ``SMShare`` or None), both None at
    construction, ``_publish`` (the publisher of the step being taken, or None),
    ``_declared(loss_fn, batch)`` (the loss as a ``LossFn``, checked against what it needs),
    ``_zero_grad()``, ``_backward(batch, loss_fn, num_tokens, num_seqs, budget, means, totals,
    where)`` (gradients summed in place), ``_step_optimizers(totals, where)`` and ``_end_step(start,
    lr, means, totals, updates, num_tokens, num_seqs)`` (schedulers, step count, metrics).

    ``AccumulatingTrainer`` is the trainer side (``accumulate`` and
    ``train_accumulated``), a mixin of ``LocalTrainer``; its docstring lists
    what the host class provides. A failed part ends the accumulation and
    drops its gradients; ``train_accumulated`` with no part raises.
    """

    def accumulate(self, part: Batch, loss_fn: LossFn, micro_batch_tokens: int | None = None,
                   sms: int | None = None) -> None:
        """Forward and backward of one part of a step's batch; the gradients wait in place for
        ``train_accumulated``, which takes the step. ``sms``: run the part's kernels on that many
        of the GPU's SMs, leaving the rest to engines decoding beside it (``trainer/sm_share.py``)."""
        loss_fn = self._declared(loss_fn, part)
        if sms and self._sm_share is None:
            self._sm_share = SMShare(self.device)
        if self._acc is None:
            self._zero_grad()
            self.compute.train()
            if self.critic is not None:
                self.critic.train()
            self._acc = Accumulation.begin(loss_fn, self.optimizer.param_groups[0]["lr"])
        acc = self._acc
        try:
            with self._sm_share.confined(sms) if sms else contextlib.nullcontext():
                self._backward(part, loss_fn, 1.0, 1, micro_batch_tokens or self.cfg.micro_batch_tokens,
                               acc.means, acc.totals, f"part {acc.parts}")
        except BaseException:
            self._acc = None  # a failed part ends the accumulation: its gradients are incomplete
            self._zero_grad()
            raise
        acc.add(part)

    def train_accumulated(self, publish=None, publish_dtype=None) -> dict[str, float]:
        """The optimizer step over every part ``accumulate`` took since the last step: the summed
        gradients divided by the batch's totals (the loss's ``needs.normaliser``), then as ``train``."""
        acc, self._acc = self._acc, None
        if acc is None or acc.parts == 0:
            raise ValueError("LocalTrainer.train_accumulated: no part was accumulated; call accumulate() first")
        try:
            acc.normalise([self.model.parameters()] + ([self.critic.parameters()] if self.critic else []))
            self._publish = (publish, publish_dtype) if publish is not None else None
            self._step_optimizers(acc.totals, f"the step over {acc.parts} parts")
        finally:
            self._publish = None
            self._zero_grad()
            self.compute.eval()
        return self._end_step(acc.start, acc.lr, acc.means, acc.totals, 1, acc.num_tokens, acc.num_seqs)
