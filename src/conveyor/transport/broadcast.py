"""Weights from trainer rank 0 to engine processes by a collective broadcast (NCCL or gloo).

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
reader's receiver thread takes every announced version into staging buckets
at once; ``poll`` copies the newest whole one into the engine. A header that
disagrees with the announcement or the layout is a ``WeightSyncError``;
every wait has ``timeout_s``. Details: docs/architecture.md ("Launch").

It knows nothing of optimizers, models or the admission rule.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from datetime import timedelta
from typing import Iterable

import torch

from conveyor.transport.weights import WeightSyncTimeout, _acquire, copy_pairs, publish_all, synchronize


class WeightSyncError(RuntimeError):
    pass


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
    """See the module docstring."""

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
        self._acks = ctx.Array("q", self.engines, lock=False)  # per engine: last serial received
        # Per engine: released at each announcement. A receiver blocks on it instead of
        # polling, so it takes the GIL from the engine's decode loop only when a version comes.
        # (Not an Event: its set() waits for every waiting process, a dead one included.)
        self._wake = [ctx.Semaphore(0) for _ in range(self.engines)]
        self._shared = set(self.__dict__) | {"_shared"}  # what travels to other processes
        self._local()

    def _local(self) -> None:
        self._group = self._store = None
        self._buckets: list[torch.Tensor] | None = None
        self._slots: dict[str, torch.Tensor] = {}
        self._filled: set[str] = set()
        self._pending_version: int | None = None
        self._works, self._sent = [], []   # broadcasts queued and not yet waited for
        self._sending: int | None = None   # the version those broadcasts carry
        # reader side
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._received = (0, -1)   # (serial, version) in the staging buckets
        self.received_at = 0.0     # when the newest complete version was in them (time.time())
        self.announced_at = 0.0    # when the writer announced that version (its begin())
        self._news = threading.Event()  # set when a complete version is received
        self._applied = 0          # serial applied to the engine
        self._copied = None        # CUDA event: the engine's copy out of the staging is done
        self._error: str | None = None

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

    # ------------------------------------------------------------- the group
    def _device(self) -> torch.device:
        if self.backend == "nccl":
            # The device is per thread: the receiver thread inherits it from poll's caller.
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _open(self, rank: int):
        import torch.distributed as dist
        timeout = timedelta(seconds=self.timeout_s)
        try:
            store = dist.TCPStore(self.host, self.port, self.engines + 1, rank == 0, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - turned into a message that names the rendezvous
            side = "trainer (rank 0)" if rank == 0 else f"engine {rank - 1}"
            raise WeightSyncError(f"weight broadcast: {side} could not join the group at "
                                  f"{self.host}:{self.port} within {self.timeout_s:.0f}s ({e}); "
                                  "an engine or the trainer did not start") from None
        prefix = dist.PrefixStore("conveyor-weights", store)
        if self.backend == "gloo":
            group = dist.ProcessGroupGloo(prefix, rank, self.engines + 1, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # The transfer runs beside a training step (writer) and decode steps (readers) that
            # fill every SM; a high-priority stream gets its kernels' blocks scheduled first.
            opts.is_high_priority_stream = True
            group = dist.ProcessGroupNCCL(prefix, rank, self.engines + 1, opts)
        self._store, self._group = store, group
        return group

    def _broadcast(self, tensors: list[torch.Tensor], stream, host: torch.Tensor | None = None) -> None:
        # One work per tensor, then wait for all; on CUDA the dedicated stream is
        # synchronised so that completion is real (and timed) on the host. ``host`` (pinned)
        # gets the first and last tensors (header and trailer) in the same synchronisation:
        # every further GPU read would take the GIL back from the engine's decode loop.
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            works = [self._group.broadcast(t, 0) for t in tensors]
            for w in works:
                w.wait()
            if host is not None:
                host.copy_(torch.cat([tensors[0], tensors[-1]]), non_blocking=True)
        if stream is not None:
            stream.synchronize()

    def _alloc(self) -> list[torch.Tensor]:
        dev = self._device()
        return [torch.empty(n, dtype=self.dtype, device=dev) for n in self.sizes]

    def _views(self, buckets: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [(name, buckets[b][off:off + math.prod(shape)].view(shape)) for name, shape, b, off in self.layout]

    # ---------------------------------------------------------------- writer
    def begin(self, version: int) -> None:
        if self._group is None:
            self._opened.value = 1
            self._open(0)
            self._buckets = self._alloc()
            self._slots = dict(self._views(self._buckets))
            self._bucket_of = {name: b for name, _, b, _ in self.layout}
            self._per_bucket = [0] * len(self.sizes)  # tensors per bucket
            for b in self._bucket_of.values():
                self._per_bucket[b] += 1
            self._stream = torch.cuda.Stream() if self.backend == "nccl" else None
            self._pinned = torch.zeros(2, 4, dtype=torch.long).pin_memory() if self.backend == "nccl" else None
        self._drain()  # the last publish's transfer, if commit(wait=False) left it running
        serial = int(self._serial.value)
        self._wait_acks(serial)  # after wait=False or an aborted publish, nobody waited for the receivers
        self._filled, self._pending_version, self._sending = set(), int(version), int(version)
        self._left = list(self._per_bucket)
        self._next, self._works, self._sent = 0, [], []
        self._queued: list[list] = [[] for _ in self._buckets]
        header = self._small([serial + 1, version, len(self.names), sum(self.sizes)])
        self._version.value = int(version)
        self._published_at.value = time.time()
        self._serial.value = serial + 1  # announce: receivers post their receives now
        for wake in self._wake:
            wake.release()
        self._send(header)

    def _small(self, values: list[int]) -> torch.Tensor:
        """Header or trailer on the group's device. A plain copy to the GPU would wait for
        every kernel queued before it (the optimizer's tail, the bucket copies): from
        pinned memory it is queued like them and the host goes on."""
        t = torch.tensor(values, dtype=torch.long)
        if self.backend != "nccl":
            return t
        # Pinned staging made once per publish slot (header 0, trailer 1): pinning costs host time.
        # Reusing it is safe: the next publish begins after this one's copies are done (_drain).
        host = self._pinned[0 if len(values) > 1 else 1][:len(values)]
        host.copy_(t)
        return host.to(self._device(), non_blocking=True)

    def _send(self, tensor: torch.Tensor) -> None:
        """Start broadcasting ``tensor``. On CUDA the broadcast stream first waits for the
        copies queued so far, so bucket k travels while bucket k + 1 is being cast."""
        self._sent.append(tensor)  # alive until the broadcast is waited for (header, trailer)
        try:
            if self._stream is None:
                self._works.append(self._group.broadcast(tensor, 0))
                return
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                self._works.append(self._group.broadcast(tensor, 0))
        except RuntimeError as e:
            self._failed(e)

    def _failed(self, e: Exception):
        self._works, self._sent, self._pending_version = [], [], None
        raise WeightSyncError(f"weight broadcast of version {self._sending} to {self.engines} engine(s) failed: "
                              f"{str(e).splitlines()[0][:300]}; an engine process died or stalled") from None

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
            self._send(self._buckets[self._next])
            self._next += 1

    def _fill(self, b: int) -> None:
        pairs, self._queued[b] = self._queued[b], []
        copy_pairs(pairs)

    def _finish(self, complete: bool, wait: bool = True) -> None:
        """Send what is left and the trailer (the serial if ``complete``, else -1: readers then
        discard what they received), then wait for every broadcast of this publish."""
        serial = int(self._serial.value)
        for b in range(self._next, len(self._buckets)):
            self._fill(b)
            self._send(self._buckets[b])
        self._next = len(self._buckets)
        self._send(self._small([serial if complete else -1]))
        if complete and not wait:
            # The transfer overlaps the caller's next work; begin() or close() drains it.
            self._pending_version = None
            return
        self._drain()
        self._pending_version = None
        if complete:
            # The root's broadcast can end before the engines' receives do (the next
            # begin() waits for them in any case, before reusing the buckets).
            self._wait_acks(serial)

    def _drain(self) -> None:
        """Wait until the root's sends of the last publish are done (they read the buckets)."""
        if not self._works:
            return
        try:
            for w in self._works:
                w.wait()
            if self._stream is not None:
                self._stream.synchronize()  # completion is real (and timed) on the host
        except RuntimeError as e:
            self._failed(e)
        self._works, self._sent = [], []

    def _wait_acks(self, serial: int) -> None:
        """Until every engine has received announcement ``serial`` (the last announced version)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            late = [i for i in range(self.engines) if self._acks[i] < serial]
            if not late:
                return
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(
                    f"weight broadcast: engine {late[0]} has not received version {self._version.value} "
                    f"(serial {serial}) within {self.timeout_s:.0f}s; its receiver is stalled or dead")
            time.sleep(0.0002)

    def commit(self, wait: bool = True) -> None:
        version = self._pending_version
        missing = [n for n in self.names if n not in self._filled]
        self._finish(complete=not missing, wait=wait)
        if missing:
            raise KeyError(f"weight publish of version {version}: missing tensors {missing[:3]}; "
                           "the engines keep the previous version")

    def abort(self) -> None:
        if self._pending_version is None:
            return
        with contextlib.suppress(Exception):  # the error that made us abort is the one to raise
            self._finish(complete=False)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        publish_all([self], named_tensors, version)

    # ---------------------------------------------------------------- reader
    def poll(self, engine, engine_id: int = 0) -> int | None:
        """Apply the newest received version to ``engine`` (see the module docstring)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._receive_loop, args=(engine_id, self._device()),
                                            name=f"engine{engine_id}-broadcast", daemon=True)
            self._thread.start()
        if self._error is not None:
            raise WeightSyncError(f"engine {engine_id} weight receiver failed:\n{self._error}")
        if self._received[0] <= self._applied:
            return None
        _acquire(self._lock, self.timeout_s, f"engine {engine_id} applying weights")
        try:
            serial, version = self._received
            if serial <= self._applied:  # an aborted publish overwrote the staging meanwhile
                return None
            engine.update_weights(self._staged, version)
            if self.backend == "nccl":
                # The next receive waits for this copy on the GPU (_receive_loop), so decoding
                # is not paused until the queued steps and the copy are done. Later kernels of
                # this stream (the next decode step) run after the copy: they see the version.
                self._copied = torch.cuda.Event()
                self._copied.record()
            else:
                synchronize(self._staging[0].device)
            self._applied = serial
            return version
        finally:
            self._lock.release()

    def wait_news(self, engine, timeout: float) -> bool:
        """Block until a version that ``poll`` would apply is received, or ``timeout`` passes
        (an engine's weight watcher: it wakes when a version lands, not on a timer)."""
        if self._received[0] > self._applied:
            return True
        self._news.clear()
        if self._received[0] > self._applied:  # landed between the check and the clear
            return True
        return self._news.wait(timeout) and self._received[0] > self._applied

    def close(self) -> None:
        """Reader: stop the receiver thread. Writer: wait for a transfer still running."""
        self._stop.set()
        self._drain()

    def _receive_loop(self, engine_id: int, device: torch.device) -> None:
        import traceback
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            while not self._opened.value:
                if self._stop.wait(0.01):
                    return
            self._open(engine_id + 1)
            self._staging = self._alloc()
            # Named views made once, not per swap: the engine's decode loop waits while they are built.
            self._staged = self._views(self._staging)
            stream = torch.cuda.Stream() if self.backend == "nccl" else None
            header = torch.zeros(4, dtype=torch.long, device=self._device())
            trailer = torch.zeros(1, dtype=torch.long, device=self._device())
            host = torch.zeros(5, dtype=torch.long).pin_memory() if stream is not None else None
            seen = 0
            while not self._stop.is_set():
                announced = int(self._serial.value)
                if announced <= seen:
                    if self._wake[engine_id].acquire(timeout=0.05):
                        while self._wake[engine_id].acquire(block=False):
                            pass  # several announcements: the serial read next covers them
                    continue
                _acquire(self._lock, self.timeout_s, f"engine {engine_id} receiving weights")
                try:
                    if self._copied is not None:  # the engine's last copy out of the staging
                        stream.wait_event(self._copied)
                    self._broadcast([header] + self._staging + [trailer], stream, host)
                    serial, version, count, numel, last = (host if host is not None
                                                           else torch.cat([header, trailer])).tolist()
                    if serial != seen + 1 or count != len(self.names) or numel != sum(self.sizes):
                        raise WeightSyncError(
                            f"engine {engine_id} received serial {serial} version {version} ({count} tensors, "
                            f"{numel} elements) but expected serial {seen + 1} with {len(self.names)} tensors "
                            f"and {sum(self.sizes)} elements; trainer and engine disagree on the weight layout")
                    seen = serial
                    if last == serial:
                        self._received, self.received_at = (serial, version), time.time()
                        self.announced_at = self.published_at  # the next begin waits for this ack
                        self._news.set()
                    else:
                        # The writer aborted mid-publish: the staging buckets hold a mix of
                        # versions, so a received but not yet applied version is lost too.
                        self._applied = self._received[0]
                finally:
                    self._lock.release()
                self._acks[engine_id] = serial
        except Exception:  # noqa: BLE001 - raised by the engine's next poll
            self._error = traceback.format_exc()
