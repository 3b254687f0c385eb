"""Versioned weight transports from the trainer to the rollout engines.

Contract: a transport has a writer side, ``publish(named_tensors, version)``,
called by whoever owns the trainer after an optimizer step, and a reader
side, ``poll(engine) -> int | None``, called by an engine's worker between
generation steps: if a newer version than the engine serves is published, it
copies the weights into the engine (``engine.update_weights``) and returns
the new version. Every lock wait has a deadline and raises
``WeightSyncTimeout`` naming the side, the version and the wait.

``StagedWeights`` keeps one staging copy of the weights, allocated once: the
writer copies into it under a lock and then bumps the version; readers copy
out under the same lock. The staging copy is what lets the trainer start its
next optimizer step while engines are still picking up the last version.
- ``StagedWeights(named, ctx=None)``: trainer and engines in one process;
  staging tensors on the trainer's device (a same-device copy), a thread lock.
- ``StagedWeights(named, ctx)``: trainer and engines in different processes
  of one machine; the staging tensors live in shared memory (CPU), the lock
  and the version counter are inter-process. Nothing crosses a pipe per
  update and no tensor is pickled.

It knows nothing of optimizers, schedules or the admission rule.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch


class WeightSyncTimeout(TimeoutError):
    pass


def weight_specs(path: str, trust_remote_code: bool = False) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of a checkpoint's state dict as the trainer holds it (float32
    master weights), read by building the model on the meta device: nothing is loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                 dtype=torch.float32)
    return [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]


def _acquire(lock, timeout: float, what: str) -> None:
    if not lock.acquire(timeout=timeout):
        raise WeightSyncTimeout(f"weight sync: {what} waited {timeout:.0f}s for the weight lock; "
                                "the other side holds it (crashed mid-copy or stalled)")


class _Cell:
    """A plain stand-in for multiprocessing.Value inside one process."""

    def __init__(self, value):
        self.value = value


class StagedWeights:
    """Versioned staging copy of the policy weights; see the module docstring."""

    def __init__(self, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], ctx=None, device="cpu"):
        """``specs``: (name, shape, dtype) of every tensor the trainer publishes."""
        import threading
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        for name, shape, dtype in specs:
            self.names.append(name)
            if ctx is None:
                self.tensors.append(torch.empty(shape, dtype=dtype, device=device))
            else:
                self.tensors.append(torch.empty(shape, dtype=dtype, device="cpu").share_memory_())
        # ``serial`` counts publishes; ``version`` is the policy version they carry.
        # Readers follow the serial, so re-publishing a version (the warm-started
        # policy is version 0 like the initial one) still reaches every engine.
        if ctx is None:
            self._serial, self._version, self._published_at = _Cell(0), _Cell(-1), _Cell(0.0)
            self._lock = threading.Lock()
        else:
            self._serial = ctx.Value("q", 0, lock=False)
            self._version = ctx.Value("q", -1, lock=False)
            self._published_at = ctx.Value("d", 0.0, lock=False)
            self._lock = ctx.Lock()
        self._seen: dict[int, int] = {}  # per reader (engine id) in this process: last serial applied

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_seen"] = {}  # a new process has applied nothing yet
        return state

    @property
    def version(self) -> int:
        return int(self._version.value)

    @property
    def published_at(self) -> float:
        return float(self._published_at.value)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                timeout: float = 60.0) -> None:
        src = dict(named_tensors)
        missing = [n for n in self.names if n not in src]
        if missing:
            raise KeyError(f"weight publish of version {version}: missing tensors {missing[:3]}")
        _acquire(self._lock, timeout, f"publisher of version {version}")
        try:
            with torch.no_grad():
                for name, dst in zip(self.names, self.tensors):
                    dst.copy_(src[name])
            self._version.value = int(version)
            self._published_at.value = time.time()
            self._serial.value += 1
        finally:
            self._lock.release()

    def poll(self, engine, timeout: float = 60.0) -> int | None:
        """Copy the newest published weights into ``engine`` if it has not applied them yet."""
        key = id(engine)
        if self._serial.value <= self._seen.get(key, 0):
            return None
        _acquire(self._lock, timeout, f"engine at version {engine.version}")
        try:
            serial, version = self._serial.value, self.version  # the newest, if it advanced meanwhile
            engine.update_weights(zip(self.names, self.tensors), version)
            self._seen[key] = serial
            return version
        finally:
            self._lock.release()
