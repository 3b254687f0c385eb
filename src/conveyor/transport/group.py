"""A collective group whose members can be replaced: it is formed anew for each membership generation.

- ``Membership`` is one rank's view of a group that rendezvous at a ``TCPStore`` hosted by
  rank 0. Whoever replaces a dead member increments the generation (``bump``), after which
  every member abandons its group and joins the next one with the same rank.
- ``join()``, ``settle()`` and ``await_newer()`` wait at most ``timeout_s``; a join that does
  not complete is a ``WeightSyncError`` naming the ranks that did not arrive.
- ``abandon()`` gives the group up without waiting for its pending operations.

It knows nothing of weights, versions or who restarts dead members.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

PREFIX = "conveyor-weights"


class WeightSyncError(RuntimeError):
    pass


def bump(generation) -> int:
    """Start the next membership generation (one writer: whoever replaces dead members)."""
    generation.value = int(generation.value) + 1
    return int(generation.value)


class Membership:
    """One rank's view of a collective group formed anew per membership generation.

    Contract: ``Membership(host, port, rank, names, backend, timeout_s, generation)``
    is one rank's view of a group of ``len(names)`` ranks (``names[r]`` says who
    rank r is, for errors) that rendezvous at the ``TCPStore`` on ``host:port``,
    hosted by rank 0 (``open()`` connects or hosts it). ``generation`` is an
    integer every member reads (a ``ctx.Value``: shared memory, or a
    ``StoreState`` value for members on other hosts); whoever replaces a dead
    member increments it (``bump(generation)``), after which every member
    abandons its group and joins the next one with the same rank.
    """

    def __init__(self, host: str, port: int, rank: int, names: list[str], backend: str, timeout_s: float,
                 generation, slice_s: float = 0.05):
        self.host, self.port, self.rank, self.names = host, int(port), int(rank), list(names)
        self.backend, self.timeout_s, self.slice_s = backend, float(timeout_s), float(slice_s)
        self._generation = generation
        self.gen = -1  # the generation of ``group``
        self.group = None
        self._store = None

    @property
    def size(self) -> int:
        return len(self.names)

    def open(self) -> None:
        import torch.distributed as dist
        try:
            self._store = dist.TCPStore(self.host, self.port, self.size, self.rank == 0,
                                        timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - turned into a message that names the rendezvous
            raise WeightSyncError(f"weight broadcast: {self.names[self.rank]} could not join the group at "
                                  f"{self.host}:{self.port} within {self.timeout_s:g}s ({e}); "
                                  "an engine or the trainer did not start") from None

    def stale(self) -> bool:
        """The generation moved on since the last join."""
        return int(self._generation.value) != self.gen

    def join(self):
        """The group of the current generation.

        ``join()`` forms the group of the current generation and returns it: each
        member marks itself present under that generation's keys in the store and
        the process group (gloo or NCCL, over a store prefix of that generation) is
        made once all are present, so a member told of a newer generation while
        waiting moves on to it instead of waiting for ranks that never come. A join
        that does not complete within ``timeout_s`` is a ``WeightSyncError`` naming
        the ranks that did not arrive.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            gen = int(self._generation.value)
            keys = [f"{PREFIX}/g{gen}/in/{r}" for r in range(self.size)]
            self._store.set(keys[self.rank], "1")
            while not self._store.check(keys):
                if int(self._generation.value) != gen:
                    break  # a newer generation: the missing ranks will be there
                if time.monotonic() > deadline:
                    missing = [self.names[r] for r, k in enumerate(keys) if not self._store.check([k])]
                    raise WeightSyncError(
                        f"weight broadcast: {', '.join(missing)} did not join group generation {gen} within "
                        f"{self.timeout_s:g}s (launch.collective_timeout_s); seen from {self.names[self.rank]}")
                time.sleep(0.01)
            else:
                self.group, self.gen = self._make(gen), gen
                return self.group

    def _make(self, gen: int):
        import torch.distributed as dist
        timeout = timedelta(seconds=self.timeout_s)
        prefix = dist.PrefixStore(f"{PREFIX}/g{gen}", self._store)
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(prefix, self.rank, self.size, timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # The transfer runs beside a training step (writer) and decode steps (readers) that
        # fill every SM; a high-priority stream gets its kernels' blocks scheduled first.
        opts.is_high_priority_stream = True
        return dist.ProcessGroupNCCL(prefix, self.rank, self.size, opts)

    def abandon(self) -> None:
        """Give the group up.

        ``abandon()`` gives the group up: the communicator is aborted (NCCL stops
        waiting at once) and the object is dropped on a thread of its own, since a
        gloo group's destructor waits for its pending operations (each ends at its
        ``timeout_s``). Tensors those operations still hold stay theirs: a caller
        that receives into a buffer allocates a new one for the next group.
        """
        if self.group is None:
            return
        # The list holds the only reference, so the group's destructor (which may wait for its
        # pending operations) runs on the thread that empties it, not here.
        holder, self.group = [self.group], None
        try:
            holder[0].abort()  # NCCL: its kernels and waits end now; gloo: operations end at their timeout
        except RuntimeError:
            pass  # a group that already failed: nothing left to stop
        threading.Thread(target=holder.clear, name=f"{self.backend}-group-release", daemon=True).start()

    def settle(self, works: list, stream=None) -> bool:
        """Wait for ``works``: True once done, False once stale.

        ``settle(works, stream)`` waits for gloo works in slices (the host sleeps
        in them: no spinning against another thread's GIL), or with NCCL polls
        ``stream`` (made to wait for the works by the caller), and returns
        False as soon as the generation moves on (the caller abandons the works);
        a failed work raises ``RuntimeError`` (a slice that runs out as the work
        completes is not a failure). It waits at most ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        step = timedelta(seconds=self.slice_s)
        for w in works if stream is None else ():  # NCCL: the caller made ``stream`` wait for them
            while True:
                try:
                    w.wait(step)
                    break
                except RuntimeError:
                    # A slice that ran out says "Operation timed out!" even when the work
                    # completed just after: its own wait() tells success from a failure
                    # (a peer died or the group broke), and re-raises the failure.
                    if w.is_completed():
                        w.wait()
                        break
                if self.stale():
                    return False
                if time.monotonic() > deadline:
                    raise RuntimeError(f"collective did not complete within {self.timeout_s:g}s") from None
        while stream is not None and not stream.query():
            if self.stale():
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"collective did not complete within {self.timeout_s:g}s")
            time.sleep(0.001)  # each look takes the GIL: an engine's decode loop runs beside it
        return True

    def await_newer(self, what: str, error: BaseException) -> None:
        """After ``error`` in a collective: return once a newer generation exists, else raise.

        ``await_newer(what, error)``: after a failed collective, wait up to
        ``timeout_s`` for a newer generation (the dead member's replacement);
        none is a ``WeightSyncError`` naming ``what``.
        """
        deadline = time.monotonic() + self.timeout_s
        while not self.stale():
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{what} failed: {str(error).splitlines()[0][:300]}; a member "
                                      f"died or stalled and was not replaced within {self.timeout_s:g}s") \
                    from None
            time.sleep(0.01)
