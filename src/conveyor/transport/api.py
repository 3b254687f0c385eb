"""The weight transport's contract: a writer on the trainer's side, a reader in each engine worker.

- ``WeightWriter``: fed after an optimizer step (``publish``, or ``begin`` / ``put`` /
  ``commit``); ``abort()`` gives a publish up and readers keep the version they had.
- ``WeightReader``: ``poll(engine, engine_id)`` between generation steps copies a newer version in.
Every wait has a deadline and raises ``WeightSyncTimeout`` naming the side
and the version. Implementations: ``weights.StagedWeights`` (one staging
copy: a device copy, shared memory or CUDA IPC; both sides),
``broadcast.BroadcastWeights`` (NCCL or gloo; both sides) and
``weights.Fanin`` (a reader over several writers).

This module holds only protocols: no torch, no engines, no schedule.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch


@runtime_checkable
class WeightWriter(Protocol):
    """``WeightWriter``: whoever owns the trainer feeds it after an optimizer
    step, either ``publish(named_tensors, version)`` or ``begin(version)``,
    ``put(name, tensor)`` for every tensor, ``commit(wait)`` (so a sharded
    trainer hands over one gathered tensor at a time and several writers are
    fed from one pass, ``weights.publish_all``); ``abort()`` gives up a begun
    publish, and readers keep the version they had. ``close()`` ends transfers
    still running. ``dtype`` is the dtype its readers take, or None.
    """
    def begin(self, version: int) -> None: ...

    def put(self, name: str, tensor: "torch.Tensor") -> None: ...

    def commit(self, wait: bool = True) -> None: ...

    def abort(self) -> None: ...

    def publish(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: int) -> None: ...

    def close(self) -> None: ...

    @property
    def dtype(self) -> "torch.dtype | None": ...


@runtime_checkable
class WeightReader(Protocol):
    """``WeightReader``: an engine worker calls ``poll(engine, engine_id)``
    between generation steps: if a newer version than ``engine`` holds is
    published it is copied in (``engine.update_weights``) and returned, else
    None. ``wait_news(engine, timeout)`` blocks until ``poll`` would copy
    something (a watcher thread wakes on it). ``received_at`` /
    ``announced_at``: when the reader held the whole newest version and when
    its writer announced it (``time.time()``), None where the transport does
    not know.
    """
    received_at: float | None
    announced_at: float | None

    def poll(self, engine: Any, engine_id: int = 0) -> int | None: ...

    def wait_news(self, engine: Any, timeout: float) -> bool: ...

    @property
    def version(self) -> int: ...
