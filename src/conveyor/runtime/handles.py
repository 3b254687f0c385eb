"""What one part of a run holds of another's capability, as protocols of the floor below both.

Contract
- ``Generator``: what a consumer of generation needs of an engine: ``generate(prompts, params)``
  (token ids in; per prompt ``params.n`` ``Completion``s, in order), its ``context_limit`` (None:
  unbounded), the GPU it computes on (``cuda_device``, None on a CPU) and ``close()``. The judge
  reward takes one (``reward/judge.py``); every ``rollout.api.RolloutEngine`` is one.
- ``EngineMemory``: the colocated engines' KV pools, ``release()``d while the trainer trains and
  ``reacquire()``d before generation (``controller.time_share.TimeShare``); the loop and the
  trainer's memory check (``trainer/fit.py``) take one.

Protocols only: nothing here runs.
"""
from __future__ import annotations

from typing import Any, Protocol

from conveyor.types import Completion, SamplingParams


class Generator(Protocol):
    """Generation as a consumer sees it; see the module docstring."""

    cuda_device: Any
    context_limit: int | None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]: ...

    def close(self) -> None: ...


class EngineMemory(Protocol):
    """The colocated engines' KV pools: released while the trainer trains, taken back before generation."""

    def release(self) -> None: ...

    def reacquire(self) -> None: ...
