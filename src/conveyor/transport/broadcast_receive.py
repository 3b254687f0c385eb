"""An engine's side of ``broadcast.BroadcastWeights``: the receiver thread and the swap into the engine.

Contract: ``Receiver(bw)``: a thread that takes every announced publish into staging buckets at
once; ``poll(engine, engine_id)`` copies the newest whole version into the engine and returns
it. It follows the group across membership generations (a replaced engine); a failure is raised
by the next ``poll`` as a ``WeightSyncError``, and every wait has the transport's ``timeout_s``.

It knows nothing of the writer's side or of the engine beyond ``update_weights``.
"""
from __future__ import annotations

import contextlib
import threading
import time
import traceback
from typing import TYPE_CHECKING

import torch

from conveyor.transport.group import WeightSyncError
from conveyor.transport.weights import _acquire, synchronize

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.transport.broadcast import BroadcastWeights


class Receiver:
    """The receiver thread of an engine's ``BroadcastWeights`` and the swap into the engine.

    Contract: ``Receiver(bw)`` is made by ``BroadcastWeights`` in every process
    and used where it reads (an engine). ``poll(engine, engine_id)`` starts the
    receiver thread at its first call; the thread joins the weight group of the
    current membership generation (rank ``engine_id + 1``), takes every
    announced publish into staging buckets at once (woken by the engine's
    semaphore, not a timer) and acknowledges its serial; ``poll`` copies the
    newest whole version into the engine under the staging lock and returns it.
    ``wait_news(timeout)`` blocks until ``poll`` would copy something. When the
    generation moves on (an engine was replaced) the thread abandons its group,
    joins the new one and takes its first message (the serial announced before
    it); a receive given up mid-transfer leaves new staging buckets (the old
    group may still write into the old ones) and the version the engine holds.
    A version sent again that the engine already holds is not copied again. A
    failure is raised by the next ``poll`` as a ``WeightSyncError``; every wait
    has the transport's ``timeout_s``.
    """

    def __init__(self, bw: BroadcastWeights):
        self._bw = bw
        self._member = None
        self._stream = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._received = (0, -1)   # (serial, version) in the staging buckets
        self.received_at = 0.0     # when the newest complete version was in them (time.time())
        self.announced_at = 0.0    # when the writer announced that version (its begin())
        self._news = threading.Event()  # set when a complete version is received
        self._applied = 0          # serial applied to the engine
        self._applied_version = -1  # and its version
        self._copied = None        # CUDA event: the engine's copy out of the staging is done
        self._error: str | None = None

    def stop(self) -> None:
        self._stop.set()

    def poll(self, engine, engine_id: int) -> int | None:
        """Apply the newest received version to ``engine`` (``BroadcastWeights.poll``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._receive_loop, args=(engine_id, self._bw._device()),
                                            name=f"engine{engine_id}-broadcast", daemon=True)
            self._thread.start()
        if self._error is not None:
            raise WeightSyncError(f"engine {engine_id} weight receiver failed:\n{self._error}")
        if self._received[0] <= self._applied:
            return None
        _acquire(self._lock, self._bw.timeout_s, f"engine {engine_id} applying weights")
        try:
            serial, version = self._received
            if serial <= self._applied:  # an aborted publish overwrote the staging meanwhile
                return None
            engine.update_weights(self._staged, version)
            if self._bw.backend == "nccl":
                # The next receive waits for this copy on the GPU (_receive_loop), so decoding
                # is not paused until the queued steps and the copy are done. Later kernels of
                # this stream (the next decode step) run after the copy: they see the version.
                self._copied = torch.cuda.Event()
                self._copied.record()
            else:
                synchronize(self._staging[0].device)
            self._applied, self._applied_version = serial, version
            return version
        finally:
            self._lock.release()

    def wait_news(self, timeout: float) -> bool:
        """Until a version that ``poll`` would apply is received, or ``timeout`` passes."""
        if self._received[0] > self._applied:
            return True
        self._news.clear()
        if self._received[0] > self._applied:  # landed between the check and the clear
            return True
        return self._news.wait(timeout) and self._received[0] > self._applied

    def _receive_loop(self, engine_id: int, device: torch.device) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            while not self._bw._opened.value:
                if self._stop.wait(0.01):
                    return
            self._member = self._bw._membership(engine_id + 1)
            self._stream = torch.cuda.Stream() if self._bw.backend == "nccl" else None
            self._restage()
            header = torch.zeros(4, dtype=torch.long, device=self._bw._device())
            trailer = torch.zeros(1, dtype=torch.long, device=self._bw._device())
            host = torch.zeros(5, dtype=torch.long).pin_memory() if self._stream is not None else None
            seen = self._rejoin(engine_id)
            while not self._stop.is_set():
                if self._member.stale():
                    seen = self._rejoin(engine_id)
                    continue
                if int(self._bw._serial.value) <= seen:
                    if self._bw._wake[engine_id].acquire(timeout=self._member.slice_s):
                        while self._bw._wake[engine_id].acquire(block=False):
                            pass  # several announcements: the serial read next covers them
                    continue
                got = self._receive(engine_id, seen, header, trailer, host)
                if got is None:  # the group was given up mid-transfer
                    seen = self._rejoin(engine_id)
                    continue
                seen = got
                self._bw._acks[engine_id] = seen
        except Exception:  # noqa: BLE001 - raised by the engine's next poll
            self._error = traceback.format_exc()

    def _restage(self) -> None:
        """New staging buckets (under the lock, or before the engine can poll): an abandoned
        receive may still write into the old ones. What they held and the engine did not take
        yet is given up: the writer sends its current version again in the new group."""
        self._staging = self._bw._alloc()
        # Named views made once, not per swap: the engine's decode loop waits while they are built.
        self._staged = self._bw._views(self._staging)
        self._applied = max(self._applied, self._received[0])

    def _rejoin(self, engine_id: int) -> int:
        """Join the current generation's group; returns the serial announced before it formed."""
        while True:
            self._member.abandon()
            self._member.join()
            base = torch.zeros(1, dtype=torch.long, device=self._bw._device())
            try:
                if not self._collective([base]):
                    continue
            except RuntimeError as e:
                self._member.await_newer(f"engine {engine_id} joining the weight broadcast group", e)
                continue
            seen = int(base.item())
            self._bw._acks[engine_id] = seen  # what was announced before this group is not coming
            return seen

    def _collective(self, tensors: list[torch.Tensor], host: torch.Tensor | None = None) -> bool:
        """Receive ``tensors``; False if the group was given up first. On CUDA ``host`` (pinned)
        gets the first and last tensors (header and trailer) in the same synchronisation:
        every further GPU read would take the GIL back from the engine's decode loop."""
        stream = self._stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            works = [self._member.group.broadcast(t, 0) for t in tensors]
            if stream is not None:
                for w in works:
                    w.wait()
                if host is not None:
                    host.copy_(torch.cat([tensors[0], tensors[-1]]), non_blocking=True)
        return self._member.settle(works, stream)

    def _receive(self, engine_id: int, seen: int, header, trailer, host) -> int | None:
        """Take the announced publish into the staging; its serial, or None if the group was given
        up meanwhile (the staging is then new and empty)."""
        _acquire(self._lock, self._bw.timeout_s, f"engine {engine_id} receiving weights")
        try:
            if self._copied is not None:  # the engine's last copy out of the staging
                self._stream.wait_event(self._copied)
            try:
                done = self._collective([header] + self._staging + [trailer], host)
            except RuntimeError as e:
                self._member.await_newer(f"engine {engine_id} receiving weights", e)
                done = False
            if not done:
                self._restage()
                return None
            serial, version, count, numel, last = (host if host is not None
                                                   else torch.cat([header, trailer])).tolist()
            if serial != seen + 1 or count != len(self._bw.names) or numel != sum(self._bw.sizes):
                raise WeightSyncError(
                    f"engine {engine_id} received serial {serial} version {version} ({count} tensors, "
                    f"{numel} elements) but expected serial {seen + 1} with {len(self._bw.names)} tensors "
                    f"and {sum(self._bw.sizes)} elements; trainer and engine disagree on the weight layout")
            if last == serial and version == self._applied_version:
                # The version it serves, sent again to a re-formed group: nothing to apply.
                self._received, self._applied = (serial, version), serial
            elif last == serial:
                self._received, self.received_at = (serial, version), time.time()
                self.announced_at = self._bw.published_at  # the next begin waits for this ack
                self._news.set()
            else:
                # The writer aborted mid-publish: the staging buckets hold a mix of
                # versions, so a received but not yet applied version is lost too.
                self._applied = self._received[0]
            return serial
        finally:
            self._lock.release()
