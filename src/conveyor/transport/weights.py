"""Versioned weight transports through one staging copy, and the helpers every transport shares.

Contract: ``StagedWeights(specs, ctx, device)`` is a ``WeightWriter`` and a
``WeightReader`` (``transport/api.py``) over one staging copy allocated once:
the writer copies into it under a lock and bumps the version, readers copy
out under the same lock, so the trainer can step again while engines pick up
the last version. ``ctx=None``: one process (a thread lock, staging on the
trainer's device); with ``ctx`` and a CPU device: shared memory across
processes; with ``ctx`` and ``cuda:i``: CUDA IPC between a trainer rank and
an engine on GPU i. ``Fanin(transports)`` reads from several writers (the
warm start, then the trainer). ``publish_all`` feeds several writers from one
pass over a trainer's tensors; ``weight_specs`` lists a checkpoint's tensors
without loading it. Every lock wait has a deadline (``WeightSyncTimeout``).

It knows nothing of optimizers, schedules or the admission rule.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterable

import torch


class WeightSyncTimeout(TimeoutError):
    pass


FLUSH_BYTES = 256 * 2**20  # a staged publish copies its queued tensors in groups of this size


def weight_specs(path: str, trust_remote_code: bool = False,
                 dedupe_tied: bool = True) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of a checkpoint's state dict as the trainer holds it (float32
    master weights), read by building the model on the meta device: nothing is loaded.
    A tensor tied to an earlier one (an output embedding shared with the input embedding)
    is listed once: engines tie it the same way, and it would double the bytes sent."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                 dtype=torch.float32)
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if dedupe_tied and id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, tuple(t.shape), t.dtype))
    return out


def synchronize(device: torch.device) -> None:
    """Wait for this thread's queued copies on ``device``: another process or thread reads
    the memory next, and on CUDA a returned copy_ may still be running."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every (destination, source) pair, one foreach call per dtype and device combination:
    a list that mixes them (bf16 linear copies and float32 norms) leaves the fused multi-tensor
    kernel for a launch per tensor, and a copy per tensor costs a launch (and a Python call) each."""
    groups: dict[tuple, list] = {}
    for dst, src in pairs:
        groups.setdefault((dst.dtype, src.dtype, dst.device, src.device), []).append((dst, src))
    with torch.no_grad():
        for group in groups.values():
            torch._foreach_copy_([d for d, _ in group], [s for _, s in group])


def _acquire(lock, timeout: float, what: str, holder=None) -> None:
    """Take ``lock`` within ``timeout``. With ``holder`` (a shared pid cell): a lock whose holder
    process has died (an engine killed while it copied a version out, then restarted) is taken
    back from it instead of waited for; readers only read the staging copy, so nothing is torn."""
    deadline = time.monotonic() + timeout
    while True:
        if lock.acquire(timeout=max(0.0, min(0.25, deadline - time.monotonic())) if holder else timeout):
            if holder is not None:
                holder.value = os.getpid()
            return
        pid = int(holder.value) if holder is not None else 0
        if pid and not _alive(pid) and int(holder.value) == pid:
            holder.value = 0
            with contextlib.suppress(ValueError):  # another waiter took it back first
                lock.release()
            continue
        if holder is None or time.monotonic() >= deadline:
            raise WeightSyncTimeout(f"weight sync: {what} waited {timeout:g}s for the weight lock; "
                                    "the other side holds it (crashed mid-copy or stalled)")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class _Cell:
    """A plain stand-in for multiprocessing.Value inside one process."""

    def __init__(self, value):
        self.value = value


class StagedWeights:
    """Versioned staging copy of the policy weights; see the module docstring. A writer and a
    reader (``transport.api``); it does not say when a reader held a version.

    - ``StagedWeights(specs)`` (``ctx=None``): trainer and engines in one process, staging on
      the trainer's ``device``, a thread lock.
    - ``StagedWeights(specs, ctx)``: processes of one machine; staging in shared memory, the
      lock and version counter inter-process; nothing crosses a pipe per update and no tensor
      is pickled.
    - ``StagedWeights(specs, ctx, device="cuda:i")``: a trainer rank and an engine on GPU i in
      two processes; the staging tensors reach the reader as CUDA IPC handles when pickled, so
      an update is two device-local copies.
    A publish copies its tensors in groups of up to ``FLUSH_BYTES`` (one foreach call per dtype).
    """

    received_at = None
    announced_at = None

    def __init__(self, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], ctx=None, device="cpu"):
        """``specs``: (name, shape, dtype) of every tensor the trainer publishes."""
        import threading
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        for name, shape, dtype in specs:
            self.names.append(name)
            t = torch.empty(shape, dtype=dtype, device=device)
            # CPU tensors go to shared memory; CUDA tensors travel as IPC handles.
            self.tensors.append(t.share_memory_() if ctx is not None and t.device.type == "cpu" else t)
        self._index = {n: i for i, n in enumerate(self.names)}
        self._filled: set[str] = set()
        self._pending: int | None = None
        self._queued: list = []  # (staging, source) pairs put and not yet copied
        self._queued_bytes = 0
        # ``serial`` counts publishes; ``version`` is the policy version they carry.
        # Readers follow the serial, so re-publishing a version (the warm-started
        # policy is version 0 like the initial one) still reaches every engine.
        if ctx is None:
            self._serial, self._version, self._published_at = _Cell(0), _Cell(-1), _Cell(0.0)
            self._lock = threading.Lock()
            self._news = threading.Event()  # set by each commit: an in-process watcher wakes on it
        else:
            self._serial = ctx.Value("q", 0, lock=False)
            self._version = ctx.Value("q", -1, lock=False)
            self._published_at = ctx.Value("d", 0.0, lock=False)
            self._lock = ctx.Lock()
            self._news = None  # across processes readers check the serial every millisecond
        # The pid holding the lock (0: none): a reader killed mid-copy does not hold it forever.
        self._holder = _Cell(0) if ctx is None else ctx.Value("q", 0, lock=False)
        self._seen: dict[int, int] = {}  # per reader (engine id) in this process: last serial applied

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_seen"] = {}  # a new process has applied nothing yet
        state["_filled"], state["_pending"], state["_queued"], state["_queued_bytes"] = set(), None, [], 0
        return state

    @property
    def version(self) -> int:
        return int(self._version.value)

    @property
    def dtype(self) -> torch.dtype | None:
        return self.tensors[0].dtype if self.tensors else None

    @property
    def published_at(self) -> float:
        return float(self._published_at.value)

    def begin(self, version: int, timeout: float = 60.0) -> None:
        _acquire(self._lock, timeout, f"publisher of version {version}", self._holder)
        self._filled, self._pending = set(), int(version)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        i = self._index.get(name)
        if i is None:
            return  # not staged (a tied duplicate)
        # Copied in groups (copy_pairs) once FLUSH_BYTES are queued, and at commit: the
        # writer's tensors stay valid until then (live weights, or a sharded trainer's
        # gathers, whose memory the flush bounds).
        self._queued.append((self.tensors[i], tensor))
        self._queued_bytes += tensor.numel() * tensor.element_size()
        if self._queued_bytes >= FLUSH_BYTES:
            self._flush()
        self._filled.add(name)

    def _flush(self) -> None:
        pairs, self._queued, self._queued_bytes = self._queued, [], 0
        copy_pairs(pairs)

    def commit(self, wait: bool = True) -> None:
        """Announce the version (complete once this returns; ``wait`` is for transports whose
        readers may still be receiving)."""
        try:
            self._flush()
            missing = [n for n in self.names if n not in self._filled]
            if missing:
                raise KeyError(f"weight publish of version {self._pending}: missing tensors {missing[:3]}")
            if self.tensors:
                synchronize(self.tensors[0].device)
            self._version.value = self._pending
            self._published_at.value = time.time()
            self._serial.value += 1
            if self._news is not None:
                self._news.set()
        finally:
            self._pending = None
            self._release()

    def abort(self) -> None:
        """Give up a begun publish (the writer failed mid-way): readers keep the last version."""
        if self._pending is not None:
            self._pending, self._queued, self._queued_bytes = None, [], 0  # nothing announced
            self._release()

    def _release(self) -> None:
        self._holder.value = 0
        self._lock.release()

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        publish_all([self], named_tensors, version)

    def close(self) -> None:
        """Nothing runs after a commit: every copy is done when it returns."""

    def poll(self, engine, engine_id: int = 0, timeout: float = 60.0) -> int | None:
        """Copy the newest published weights into ``engine`` if it has not applied them yet."""
        key = id(engine)
        if self._serial.value <= self._seen.get(key, 0):
            return None
        _acquire(self._lock, timeout, f"engine at version {engine.version}", self._holder)
        try:
            serial, version = self._serial.value, self.version  # the newest, if it advanced meanwhile
            engine.update_weights(zip(self.names, self.tensors), version)
            if self.tensors:
                synchronize(self.tensors[0].device)
            self._seen[key] = serial
            return version
        finally:
            self._release()

    def wait_news(self, engine, timeout: float) -> bool:
        """Until ``poll`` would apply a version to ``engine`` or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while self._serial.value <= self._seen.get(id(engine), 0):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._news is None:
                time.sleep(min(left, 0.001))
            else:
                self._news.clear()
                if self._serial.value <= self._seen.get(id(engine), 0):
                    self._news.wait(left)
        return True


class Fanin:
    """An engine fed by several writers: poll each; the last one with news wins."""

    def __init__(self, transports: list):
        self.transports = list(transports)
        self._last = None  # the transport that delivered the version applied last

    @property
    def received_at(self) -> float | None:
        return None if self._last is None else self._last.received_at

    @property
    def announced_at(self) -> float | None:
        return None if self._last is None else self._last.announced_at

    @property
    def version(self) -> int:
        return max(t.version for t in self.transports)

    def wait_news(self, engine, timeout: float) -> bool:
        # The last writer is the trainer; the others (the warm start) are checked without waiting.
        return (any(t.wait_news(engine, 0.0) for t in self.transports[:-1])
                or self.transports[-1].wait_news(engine, timeout))

    def poll(self, engine, engine_id: int = 0) -> int | None:
        got = None
        for t in self.transports:
            v = t.poll(engine, engine_id)
            if v is not None:
                got, self._last = v, t
        return got


def publish_all(transports: list, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                wait: bool = True) -> None:
    """One pass over ``named_tensors`` (a sharded trainer gathers each once) feeding every transport.
    ``wait=False`` returns before every reader holds the version (broadcast): only for callers
    whose readers wait for the version they need themselves (``engine_loop``'s chunks)."""
    for t in transports:
        t.begin(version)
    try:
        for name, tensor in named_tensors:
            for t in transports:
                t.put(name, tensor)
    except BaseException:
        for t in transports:
            t.abort()
        raise
    for t in transports:
        t.commit(wait)
