"""Weights from trainer rank 0 to engine processes by a collective broadcast (NCCL or gloo).

- ``BroadcastWeights`` is a ``WeightWriter`` for trainer rank 0 and a ``WeightReader`` for
  every engine (``transport/api.py``): tensors travel in the engines' dtype in flat buckets; a
  version is whole or discarded, and no bucket is overwritten while read.
- Every wait has ``timeout_s``; a header that disagrees with the announcement or the layout is
  a ``WeightSyncError``.
- Replaced engines: ``regroup()`` re-forms the group (``group.Membership``) and the writer sends
  the current weights again, so a replacement holds them.

It knows nothing of optimizers, models, the admission rule or who restarts engines.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import traceback
from typing import Iterable

import torch

from conveyor.transport.broadcast_receive import Receiver
from conveyor.transport.group import Membership, WeightSyncError, bump
from conveyor.transport.weights import WeightSyncTimeout, _acquire, copy_pairs, publish_all

__all__ = ["BroadcastWeights", "WeightSyncError"]
logger = logging.getLogger(__name__)


def _layout(specs, dtype: torch.dtype, bucket_mb: float) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, bucket, offset) for every tensor; buckets hold at most bucket_mb MiB
    (a tensor larger than that gets a bucket of its own)."""
    cap = max(1, int(bucket_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
    out, bucket, used = [], 0, 0
    for name, shape, _ in specs:
        n = math.prod(shape)
        if used and used + n > cap:
            bucket, used = bucket + 1, 0
        out.append((name, tuple(shape), bucket, used))
        used += n
    return out


class BroadcastWeights:
    """Weights by collective broadcast: the writer on trainer rank 0, a reader per engine.

    Contract: ``BroadcastWeights(specs, ctx, engines, backend, dtype, port,
    bucket_mb, timeout_s)`` is a ``WeightWriter`` for trainer rank 0 and a
    ``WeightReader`` for engines 0..engines-1 (``transport/api.py``), made by the
    controller and pickled to both. Tensors travel in ``dtype`` (the engines')
    in flat buckets of at most ``bucket_mb`` MiB; a bucket is sent as soon as its
    last tensor is put. ``begin`` waits until every engine received the previous
    version (no bucket is overwritten while read), then sends a header
    ``[serial, version, tensors, numel]``; ``commit`` sends a trailer
    ``[serial]`` (``[-1]`` for a failed or incomplete publish, which engines
    discard) and, unless ``wait=False``, returns once every engine holds it. A
    reader's receiver thread (``broadcast_receive.Receiver``) takes every
    announced version into staging buckets at once; ``poll`` copies the newest
    whole one into the engine. A header that
    disagrees with the announcement or the layout is a ``WeightSyncError``;
    every wait has ``timeout_s``.
    """

    def __init__(self, specs, ctx, engines: int, backend: str = "gloo", dtype: torch.dtype = torch.float32,
                 port: int = 0, bucket_mb: float = 512.0, timeout_s: float = 120.0, host: str = "127.0.0.1"):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"BroadcastWeights backend {backend!r}: use nccl (GPUs) or gloo (CPU)")
        self.layout = _layout(list(specs), dtype, bucket_mb)
        self.names = [n for n, *_ in self.layout]
        self.sizes = [0] * (1 + max((b for *_, b, _ in self.layout), default=0))
        for _, shape, b, off in self.layout:  # a bucket ends where its last tensor does
            self.sizes[b] = off + math.prod(shape)
        self.engines, self.backend, self.dtype = int(engines), backend, dtype
        self.host, self.port, self.timeout_s = host, int(port), float(timeout_s)
        self._serial = ctx.Value("q", 0, lock=False)      # announced publishes
        self._version = ctx.Value("q", -1, lock=False)    # policy version of the announced publish
        self._published_at = ctx.Value("d", 0.0, lock=False)
        self._opened = ctx.Value("b", 0, lock=False)      # the writer hosts the store from now on
        self._generation = ctx.Value("q", 0, lock=False)  # membership generation (group.py)
        self._acks = ctx.Array("q", self.engines, lock=False)  # per engine: last serial received
        # Per engine: released at each announcement. A receiver blocks on it instead of
        # polling, so it takes the GIL from the engine's decode loop only when a version comes.
        # (Not an Event: its set() waits for every waiting process, a dead one included.)
        self._wake = [ctx.Semaphore(0) for _ in range(self.engines)]
        self._shared = set(self.__dict__) | {"_shared"}  # what travels to other processes
        self._local()

    def _local(self) -> None:
        self._member: Membership | None = None
        self._stream = None
        self._buckets: list[torch.Tensor] | None = None
        self._slots: dict[str, torch.Tensor] = {}
        self._filled: set[str] = set()
        self._pending_version: int | None = None
        self._works, self._sent = [], []   # broadcasts queued and not yet waited for
        self._sending: int | None = None   # the version those broadcasts carry
        self._next = 0                     # buckets of this publish sent so far
        self._trailer: bool | None = None  # this publish's trailer went out: complete (True) or not
        self._whole = False                # the buckets hold the last complete version
        self._broken: Exception | None = None  # a send failed: the next wait recovers
        self._publishing = threading.Lock()    # from begin to the end of commit/abort, and a re-formation
        self._watch_error: str | None = None
        self._stop = threading.Event()      # the writer's membership watcher ends
        self._rx = Receiver(self)            # an engine's side (broadcast_receive.py)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k in self._shared}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local()

    @property
    def version(self) -> int:
        return int(self._version.value)

    @property
    def published_at(self) -> float:
        return float(self._published_at.value)

    @property
    def generation(self) -> int:
        return int(self._generation.value)

    def regroup(self) -> int:
        """A dead engine is being replaced: every member re-forms the group (below).
        Called by the one that restarts engines; returns the new generation.

        Replaced engines: the group is one membership generation (``group.Membership``).
        ``regroup()`` (the controller, when it starts a replacement for a dead
        engine) begins the next one: the writer and every reader abandon their group
        and join the new one with the same rank; the first message in a group is
        the serial announced before it formed (a reader's next header is the one
        after). The writer then sends again, under a new serial, the publish it was
        in (what it had sent so far) or else its last complete version, so the
        replacement, and a survivor that lost a transfer, hold the current weights;
        a survivor keeps serving on the version it holds meanwhile. The writer's
        waits and a thread beside it (between publishes) watch the generation; a
        failed broadcast waits ``timeout_s`` for one before it is an error. After
        an aborted publish there is no complete version to send again: a
        replacement gets the next publish.
        """
        return bump(self._generation)

    # ------------------------------------------------------------- the group
    def _device(self) -> torch.device:
        if self.backend == "nccl":
            # The device is per thread: the receiver thread inherits it from poll's caller.
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _membership(self, rank: int) -> Membership:
        names = ["trainer (rank 0)"] + [f"engine {i}" for i in range(self.engines)]
        member = Membership(self.host, self.port, rank, names, self.backend, self.timeout_s, self._generation)
        member.open()
        return member

    def _alloc(self) -> list[torch.Tensor]:
        dev = self._device()
        return [torch.empty(n, dtype=self.dtype, device=dev) for n in self.sizes]

    def _views(self, buckets: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [(name, buckets[b][off:off + math.prod(shape)].view(shape)) for name, shape, b, off in self.layout]

    # ---------------------------------------------------------------- writer
    def _open_writer(self) -> None:
        self._opened.value = 1
        self._buckets = self._alloc()
        self._slots = dict(self._views(self._buckets))
        self._bucket_of = {name: b for name, _, b, _ in self.layout}
        self._per_bucket = [0] * len(self.sizes)  # tensors per bucket
        for b in self._bucket_of.values():
            self._per_bucket[b] += 1
        self._stream = torch.cuda.Stream() if self.backend == "nccl" else None
        # Pinned staging of the small messages: header, trailer, generation's first message.
        self._pinned = torch.zeros(3, 4, dtype=torch.long).pin_memory() if self.backend == "nccl" else None
        self._member = self._membership(0)
        self._reform()
        self._drain()
        threading.Thread(target=self._watch, name="weight-broadcast-members", daemon=True).start()

    def begin(self, version: int) -> None:
        # A re-formation holds the lock while the group forms (timeout_s) and the last version is
        # sent again (timeout_s).
        _acquire(self._publishing, 3 * self.timeout_s, f"weight publish of version {version}")
        try:
            if self._watch_error is not None:
                raise WeightSyncError(f"weight broadcast: re-forming the group failed:\n{self._watch_error}")
            if self._member is None:
                self._open_writer()
            self._drain()  # the last publish's transfer, if commit(wait=False) left it running
            self._wait_acks()  # after wait=False or an aborted publish, nobody waited for the receivers
            self._filled, self._pending_version, self._sending = set(), int(version), int(version)
            self._whole, self._trailer, self._left = False, None, list(self._per_bucket)
            self._next = 0
            self._queued: list[list] = [[] for _ in self._buckets]
            self._announce()
        except BaseException:
            self._pending_version = None
            self._publishing.release()
            raise

    def _announce(self) -> None:
        """A new serial for the version in ``_sending``: receivers post their receives now."""
        serial = int(self._serial.value) + 1
        header = self._small([serial, self._sending, len(self.names), sum(self.sizes)], 0)
        self._version.value = self._sending
        self._published_at.value = time.time()
        self._serial.value = serial
        for wake in self._wake:
            wake.release()
        self._send(header)

    def _small(self, values: list[int], slot: int) -> torch.Tensor:
        """Header (slot 0), trailer (1) or a group's first message (2) on the group's device. A
        plain copy to the GPU would wait for every kernel queued before it (the optimizer's tail,
        the bucket copies): from pinned memory it is queued like them and the host goes on."""
        t = torch.tensor(values, dtype=torch.long)
        if self.backend != "nccl":
            return t
        # Pinning costs host time: made once. Reusing a slot is safe: the next publish begins
        # after this one's copies are done (_drain), and a re-formation abandons them first.
        host = self._pinned[slot][:len(values)]
        host.copy_(t)
        return host.to(self._device(), non_blocking=True)

    def _send(self, tensor: torch.Tensor) -> None:
        """Start broadcasting ``tensor``. On CUDA the broadcast stream first waits for the
        copies queued so far, so bucket k travels while bucket k + 1 is being cast. A failure is
        kept for the next wait, which re-forms the group and sends this publish again."""
        self._sent.append(tensor)  # alive until the broadcast is waited for (header, trailer)
        if self._broken is not None:
            return
        group = self._member.group
        try:
            if self._stream is None:
                self._works.append(group.broadcast(tensor, 0))
                return
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                self._works.append(group.broadcast(tensor, 0))
        except RuntimeError as e:
            self._broken = e

    def put(self, name: str, tensor: torch.Tensor) -> None:
        slot = self._slots.get(name)
        if slot is None:
            return  # not sent (e.g. an output embedding tied to the input one)
        b = self._bucket_of[name]
        # Copied with the rest of its bucket in one foreach call when the bucket is complete:
        # a launch (and Python call) per tensor made the host the slow side of a publish.
        # Writers hand tensors that stay valid until commit (live weights, fresh gathers).
        self._queued[b].append((slot, tensor))  # copied under no_grad: no detach (1.5 us x 300)
        if name not in self._filled:
            self._filled.add(name)
            self._left[b] -= 1
        # Buckets go out in order, each as soon as all of its tensors are in.
        while self._next < len(self._left) and self._left[self._next] == 0:
            self._fill(self._next)
            self._next += 1
            self._send(self._buckets[self._next - 1])

    def _fill(self, b: int) -> None:
        pairs, self._queued[b] = self._queued[b], []
        copy_pairs(pairs)

    def _finish(self, complete: bool, wait: bool = True) -> None:
        """Send what is left and the trailer (the serial if ``complete``, else -1: readers then
        discard what they received), then wait for every broadcast of this publish."""
        for b in range(self._next, len(self._buckets)):
            self._fill(b)
            self._send(self._buckets[b])
        self._next = len(self._buckets)
        self._trailer, self._whole = complete, complete
        self._send(self._small([int(self._serial.value) if complete else -1], 1))
        if complete and not wait:
            # The transfer overlaps the caller's next work; begin() or close() drains it.
            self._pending_version = None
            return
        self._drain()
        self._pending_version = None
        if complete:
            # The root's broadcast can end before the engines' receives do (the next
            # begin() waits for them in any case, before reusing the buckets).
            self._wait_acks()

    def _drain(self) -> None:
        """Until the sends queued so far are done (they read the buckets). A group that broke
        or whose generation moved on is re-formed, and what it carried is sent again."""
        while True:
            if self._broken is not None:
                self._member.await_newer(f"weight broadcast of version {self._sending} to {self.engines} "
                                         "engine(s)", self._broken)
            if self._member.stale():
                self._reform()
                continue
            if not self._works:
                return
            if self._stream is not None:
                for w in self._works:
                    w.wait()  # the stream waits for them; settle polls it
            try:
                if self._member.settle(self._works, self._stream):
                    self._works, self._sent = [], []
                    return
            except RuntimeError as e:
                self._broken = e

    def _reform(self) -> None:
        """Join the current generation's group and queue, in it, the serial announced so far and
        then the publish under way (what of it was sent) or else the last complete version."""
        self._member.abandon()
        self._works, self._sent, self._broken = [], [], None
        self._member.join()
        self._send(self._small([int(self._serial.value)], 2))
        resend = self._pending_version is not None or self._whole
        if self._member.gen > 0:
            logger.warning("weight broadcast: group re-formed as generation %d with %d engine(s); %s",
                           self._member.gen, self.engines,
                           f"version {self._sending} sent again" if resend else "no complete version to send")
        if not resend:
            return  # nothing whole to send again: the next publish is
        self._announce()
        for b in range(self._next):
            self._send(self._buckets[b])
        if self._trailer is not None:
            self._send(self._small([int(self._serial.value) if self._trailer else -1], 1))

    def _wait_acks(self) -> None:
        """Until every engine has received the last announced serial (a re-formation moves it on)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            serial = int(self._serial.value)
            late = [i for i in range(self.engines) if self._acks[i] < serial]
            if not late:
                return
            if self._member.stale():
                self._drain()  # re-forms the group and sends the version again
                deadline = time.monotonic() + self.timeout_s
                continue
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(
                    f"weight broadcast: engine {late[0]} has not received version {self._version.value} "
                    f"(serial {serial}) within {self.timeout_s:g}s; its receiver is stalled or dead")
            time.sleep(0.0002)

    def _watch(self) -> None:
        """Between publishes: re-form the group when a dead engine is replaced (a publish under
        way does it in its own waits), so the replacement gets the current version."""
        while not self._stop.wait(self._member.slice_s):
            if self._watch_error is not None or not self._member.stale():
                continue
            if not self._publishing.acquire(timeout=self._member.slice_s):
                continue
            try:
                if self._member.stale():
                    self._drain()
            except Exception:  # noqa: BLE001 - raised by the next begin()
                self._watch_error = traceback.format_exc()
            finally:
                self._publishing.release()

    def commit(self, wait: bool = True) -> None:
        try:
            version = self._pending_version
            missing = [n for n in self.names if n not in self._filled]
            self._finish(complete=not missing, wait=wait)
            if missing:
                raise KeyError(f"weight publish of version {version}: missing tensors {missing[:3]}; "
                               "the engines keep the previous version")
        finally:
            self._pending_version = None
            self._publishing.release()

    def abort(self) -> None:
        if self._pending_version is None:
            return
        try:
            with contextlib.suppress(Exception):  # the error that made us abort is the one to raise
                self._finish(complete=False)
        finally:
            self._pending_version = None
            self._publishing.release()

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        publish_all([self], named_tensors, version)

    def close(self) -> None:
        """Reader: stop the receiver thread. Writer: wait for a transfer still running (in the
        group it began in: a run that ends does not wait for a replacement)."""
        self._stop.set()
        self._rx.stop()
        if self._buckets is None or not self._works:
            return
        _acquire(self._publishing, 3 * self.timeout_s, "closing the weight broadcast")
        try:
            if self._broken is None and not self._member.stale():
                if self._stream is not None:
                    for w in self._works:
                        w.wait()
                if not self._member.settle(self._works, self._stream):
                    self._member.abandon()
        except RuntimeError as e:
            raise WeightSyncError(f"weight broadcast of version {self._sending} failed: "
                                  f"{str(e).splitlines()[0][:300]}; an engine process died or stalled") from None
        finally:
            self._works, self._sent = [], []
            self._publishing.release()

    # ---------------------------------------------------------------- reader
    @property
    def received_at(self) -> float:
        """When the newest complete version was in this engine's staging (``time.time()``)."""
        return self._rx.received_at

    @property
    def announced_at(self) -> float:
        """When the writer announced that version (its begin())."""
        return self._rx.announced_at

    def poll(self, engine, engine_id: int = 0) -> int | None:
        """Apply the newest received version to ``engine``."""
        return self._rx.poll(engine, engine_id)

    def wait_news(self, engine, timeout: float) -> bool:
        """Block until a version that ``poll`` would apply is received, or ``timeout`` passes
        (an engine's weight watcher: it wakes when a version lands, not on a timer)."""
        return self._rx.wait_news(timeout)
