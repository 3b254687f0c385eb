"""What every multi-rank trainer does over its process group, whatever it keeps on a rank.

``RankGroup`` is a mixin for ``LocalTrainer`` subclasses whose ranks share the default
``torch.distributed`` group: ``FSDPTrainer`` (``fsdp.py``: each rank holds a shard) and
``ReplicatedTrainer`` (``replicated.py``: each rank holds the whole model). Its helpers are
COLLECTIVE (every rank calls them, in the same order) and never leave a rank waiting in a
collective that another rank will not reach; ``RankGroup`` lists them.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from conveyor.trainer.api import LossFn
from conveyor.trainer.single import NonFiniteLossError
from conveyor.trainer.step_metrics import MetricMean
from conveyor.types import Batch

BUCKET_BYTES = 256 * 2**20  # a flat all-reduce buffer: few collectives, bounded extra memory


class RankGroup:
    """- ``_agree(fn, what)``: run ``fn`` here; if it raised on any rank, raise on every rank;
    - ``_broadcast(obj)``: rank 0's picklable object on every rank;
    - ``_rows(values)``: every rank's list of floats, in rank order; ``_raise_failures`` raises a
      failure or a non-finite loss of any rank on every rank;
    - ``_merge_means``: the step's per-rank metric sums, merged in rank order (the same on every rank);
    - ``_sum(tensors)``: tensors summed over ranks in place (flat buckets per dtype);
    - ``_gather_samples``: per-sample results computed on the ranks, back in batch order on every rank;
    - ``train`` reports the slowest rank's ``time_s``; ``accumulate`` is refused (one rank only).
    """
    rank: int
    world: int
    device: torch.device
    _step: int

    def _agree(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` here; if it raised on ANY rank, raise on every rank (nobody waits in a collective)."""
        err, result = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            err = e
        flags = torch.zeros(self.world, device=self.device)
        flags[self.rank] = float(err is not None)
        dist.all_reduce(flags)
        bad = [r for r in range(self.world) if flags[r] > 0]
        if err is not None:
            raise err
        if bad:
            raise RuntimeError(f"{what} failed on rank(s) {bad}; see the error there")
        return result

    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _rows(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same length on every rank), in rank order."""
        t = torch.zeros(self.world, len(values), dtype=torch.float64, device=self.device)
        t[self.rank] = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)  # NaN/inf survive the sum of zeros, in their own row
        return t.tolist()

    def _raise_failures(self, rows: list[list[float]], err: Exception | None, where: str, failing: str,
                        cleanup: Callable[[], None] | None = None) -> None:
        """``rows``: every rank's ``[loss, ..., failed flag]``. A failure or a non-finite loss on any rank
        raises on every rank (this rank's own error where it has one), after ``cleanup``."""
        failed = [r for r, row in enumerate(rows) if row[-1] > 0]
        bad = [r for r, row in enumerate(rows) if not math.isfinite(row[0])]
        if not (failed or bad):
            return
        if cleanup is not None:
            cleanup()
        if err is not None:
            raise err
        if failed:
            raise RuntimeError(f"trainer step {self._step}, {where}: {failing} failed on rank(s) {failed}; "
                               "see the error there")
        raise NonFiniteLossError(
            f"trainer step {self._step}, {where}: loss is {rows[bad[0]][0]} on rank(s) {bad}; no optimizer step "
            "was taken (check the loss inputs, e.g. advantages and logprob ratios, and the learning rate)")

    def _merge_means(self, means: MetricMean, local: MetricMean) -> None:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (local.wsum, local.plain, local.weight, local.count))
        for wsum, plain, weight, count in parts:  # rank order: the same sums on every rank
            for k, v in wsum.items():
                means.wsum[k] = means.wsum.get(k, 0.0) + v
            for k, v in plain.items():
                means.plain[k] = means.plain.get(k, 0.0) + v
            means.weight += weight
            means.count += count

    def _sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` over the ranks, in place: one all-reduce per flat bucket of one dtype.
        Every rank passes the same list (shapes and dtypes, in order)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            bucket: list[torch.Tensor] = []
            used = 0
            for t in group + [None]:  # None: flush the last bucket
                if t is not None and (not bucket or used + t.numel() * t.element_size() <= BUCKET_BYTES):
                    bucket.append(t)
                    used += t.numel() * t.element_size()
                    continue
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat)
                torch._foreach_copy_(bucket, [f.view_as(b) for f, b in
                                              zip(flat.split([b.numel() for b in bucket]), bucket)])
                bucket, used = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)

    def _gather_samples(self, local: list[tuple[int, torch.Tensor]], n: int) -> list[torch.Tensor]:
        """``(index, tensor)`` pairs computed on each rank -> the ``n`` tensors in index order, everywhere."""
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, local)
        result: list[torch.Tensor | None] = [None] * n
        for part in parts:
            for i, t in part:
                result[i] = t
        return result  # type: ignore[return-value]

    def accumulate(self, part: Batch, loss_fn: LossFn, micro_batch_tokens: int | None = None,
                   sms: int | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__}: a step accumulated part by part runs on one trainer "
                                  "rank; set loop.accumulate_groups=0 or launch.trainer_ranks=1")

    def train(self, batch: Batch, loss_fn: LossFn, publish=None, publish_dtype=None) -> dict[str, float]:
        metrics = super().train(batch, loss_fn, publish, publish_dtype)  # type: ignore[misc]
        t = torch.tensor([metrics["time_s"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        metrics["time_s"] = float(t)
        return metrics
