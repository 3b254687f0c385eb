"""A train step's loss-function metrics: read back from the device once, averaged by loss tokens.

Contract
- ``to_host(rows)`` turns ``(loss, metrics, weight)`` rows whose entries may be
  device tensors into the same rows as floats with one transfer (a read per
  micro-batch would stall the GPU queue each time).
- ``MetricMean`` accumulates per-micro-batch metrics weighted by their loss
  tokens (a plain mean when no micro-batch has any) and returns the averages.
"""
from __future__ import annotations

from typing import Any

import torch


def to_host(rows: list[tuple[torch.Tensor, dict[str, Any], torch.Tensor]], device: torch.device):
    """``(loss, metrics, weight)`` rows with tensor entries -> the same rows as floats, in one transfer."""
    flat = [t for loss, metrics, weight in rows
            for t in (loss, weight, *(v for v in metrics.values() if isinstance(v, torch.Tensor)))]
    values = iter(torch.stack([t.detach().float().reshape(()).to(device) for t in flat]).tolist() if flat else [])
    out = []
    for _, metrics, _ in rows:
        loss, weight = next(values), next(values)
        out.append((loss, {k: next(values) if isinstance(v, torch.Tensor) else float(v)
                           for k, v in metrics.items()}, weight))
    return out


class MetricMean:
    """Loss-function metrics averaged over micro-batches, weighted by their loss tokens."""

    def __init__(self) -> None:
        self.wsum: dict[str, float] = {}
        self.plain: dict[str, float] = {}
        self.weight = 0.0
        self.count = 0

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        for k, v in metrics.items():
            v = float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
            self.wsum[k] = self.wsum.get(k, 0.0) + weight * v
            self.plain[k] = self.plain.get(k, 0.0) + v
        self.weight += weight
        self.count += 1

    def result(self) -> dict[str, float]:
        if self.weight > 0:
            return {k: v / self.weight for k, v in self.wsum.items()}
        # No loss tokens anywhere: weights are all 0, fall back to a plain mean.
        return {k: v / max(1, self.count) for k, v in self.plain.items()}
