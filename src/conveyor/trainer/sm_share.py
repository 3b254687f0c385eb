"""The trainer's kernels confined to part of a GPU's SMs while engines decode on the same GPU
(``loop.accumulate_sms``, CUDA green contexts).

A training GEMM's blocks fill every SM for milliseconds, so an engine's small decode kernels
queued behind them wait; run the trainer's part in a green context of ``sms`` SMs and the rest
stay free for the engine (training slower by about total / ``sms``; results unchanged).
- ``check(sms, device=None)`` raises ``ConfigError`` with a one-line fix where ``sms`` cannot
  work. 0 passes.
- ``SMShare(device).confined(sms)``: the calling thread's kernels on at most ``sms`` SMs, in
  order with the current stream's work.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from conveyor.config.base import ConfigError


def total_sms(device: torch.device | None = None) -> int:
    return int(torch.cuda.get_device_properties(device or torch.cuda.current_device()).multi_processor_count)


def check(sms: int, device: torch.device | None = None) -> None:
    """Refuse an SM count that cannot confine the trainer on ``device`` (default: the current GPU).

    ``check(sms, device=None)`` raises ``ConfigError`` (a ``ValueError``) with a one-line fix where ``sms`` cannot
    work: no CUDA device, a torch without green contexts, a count outside 1 .. SMs - 1. 0 passes.
    """
    if not sms:
        return
    fix = "or set loop.accumulate_sms=0"
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"loop.accumulate_sms={sms} confines the trainer to part of a GPU, and it trains on "
                         f"{device.type if device is not None else 'cpu'}; {fix}")
    from torch.cuda import green_contexts
    if not green_contexts.SUPPORTED:
        raise ConfigError(f"loop.accumulate_sms={sms} needs CUDA green contexts, which this torch "
                         f"{torch.__version__} lacks (CUDA 12.4+ and a driver that has them); {fix}")
    n = total_sms(device)
    if not 0 < sms < n:
        raise ConfigError(f"loop.accumulate_sms={sms}: this GPU has {n} SMs; give 1..{n - 1} "
                         f"(about {n * 3 // 4} leaves a quarter to the engine), {fix}")


class SMShare:
    """Green contexts of a device, one per SM count, made when first asked for.

    A part of a synchronous step trained while the engine finishes the step's long samples
    (``loop.accumulate_groups``) competes with the engine for the GPU. The engine's decode steps in
    that tail are small, latency-bound kernels; a training GEMM's blocks fill every SM for
    milliseconds, so a decode kernel queued behind them waits even on a high-priority stream (blocks
    are not pre-empted). Run the part in a green context of ``sms`` SMs and the remaining SMs stay
    free for the engine: training is slower by about total / ``sms``, decoding is not held up.

    ``SMShare(device)``: ``confined(sms)`` is a context manager under which the calling thread's
    kernels, queued on the current stream, run on at most ``sms`` SMs. One green context per count
    is made on first use and kept. On entry its stream waits for the current stream's queued work;
    on exit the current stream waits for the green stream's, so tensors pass between the two in
    order. ``sms`` None or 0: nothing changes. Results are the same as without it (the same kernels
    on fewer SMs), not faster.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._contexts: list = []  # kept alive as long as their streams are used

    def _stream(self, sms: int) -> torch.cuda.Stream:
        if sms not in self._streams:
            check(sms, self.device)
            from torch.cuda.green_contexts import GreenContext
            ctx = GreenContext.create(num_sms=sms, device_id=self.device.index or 0)
            self._contexts.append(ctx)
            self._streams[sms] = ctx.Stream()
        return self._streams[sms]

    @contextmanager
    def confined(self, sms: int | None) -> Iterator[None]:
        if not sms:
            yield
            return
        green = self._stream(sms)
        here = torch.cuda.current_stream(self.device)
        green.wait_stream(here)
        try:
            with torch.cuda.stream(green):
                yield
        finally:
            here.wait_stream(green)
