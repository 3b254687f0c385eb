"""Shared counters in a ``torch.distributed.TCPStore``, for transports whose roles may be on other hosts.

Contract: ``StoreState(host, port, prefix)`` stands in for the multiprocessing context a
transport is built with: its ``Value``, ``Array`` and ``Semaphore`` keep their state in the
store instead of shared memory, so they pickle to any process that can reach it and every
process sees the same numbers. The store server is the caller's (``serve_store``): it must
outlive every process that uses the state.

It knows nothing of weights or of what the counters mean.
"""
from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta

_clients: dict[tuple[str, int], object] = {}
_clients_lock = threading.Lock()


def serve_store(host: str, timeout_s: float):
    """A store server on ``host`` (port chosen by the system); keep the object alive while it is used."""
    import torch.distributed as dist
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def _client(host: str, port: int, timeout_s: float):
    with _clients_lock:
        store = _clients.get((host, port))
        if store is None:
            import torch.distributed as dist
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
            _clients[(host, port)] = store
        return store


class _Keyed:
    def __init__(self, state: StoreState, key: str):
        self._state, self._key = state, key

    @property
    def _store(self):
        return self._state.store()


class StoreValue(_Keyed):
    def __init__(self, state: StoreState, key: str, typecode: str, init):
        super().__init__(state, key)
        self._float = typecode in ("d", "f")
        self.value = init

    @property
    def value(self):
        if self._float:
            return float(self._store.get(self._key).decode())
        return int(self._store.add(self._key, 0))

    @value.setter
    def value(self, v) -> None:
        self._store.set(self._key, repr(float(v)) if self._float else str(int(v)))


class StoreArray(_Keyed):
    def __init__(self, state: StoreState, key: str, n: int, read_pause_s: float):
        super().__init__(state, key)
        self._n, self._pause = int(n), read_pause_s
        for i in range(self._n):
            self[i] = 0

    def __len__(self) -> int:
        return self._n

    def _item(self, i: int) -> str:
        if not 0 <= i < self._n:
            raise IndexError(f"{self._key}[{i}] out of range 0..{self._n - 1}")
        return f"{self._key}/{i}"

    def __getitem__(self, i: int) -> int:
        time.sleep(self._pause)
        return int(self._store.add(self._item(i), 0))

    def __setitem__(self, i: int, v: int) -> None:
        self._store.set(self._item(i), str(int(v)))


class StoreSemaphore(_Keyed):
    """A counting semaphore with one consumer (the reader it wakes)."""

    def __init__(self, state: StoreState, key: str, init: int, poll_s: float):
        super().__init__(state, key)
        self._poll = poll_s
        self._store.set(self._key, str(int(init)))

    def release(self) -> None:
        self._store.add(self._key, 1)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._store.add(self._key, 0) > 0:
                self._store.add(self._key, -1)
                return True
            if not block or (deadline is not None and time.monotonic() >= deadline):
                return False
            time.sleep(self._poll if deadline is None else max(0.0, min(self._poll, deadline - time.monotonic())))


class StoreState:
    """A multiprocessing context's shared values, kept in a TCPStore.

    Contract: ``StoreState(host, port, prefix)`` stands in for the multiprocessing
    context a transport is built with (``BroadcastWeights(specs, ctx, ...)``): its
    ``Value(typecode, init, lock=False)``, ``Array("q", n, lock=False)`` and
    ``Semaphore(0)`` keep their state in the store at ``host:port`` instead of
    shared memory, so the objects pickle to any process that can reach that
    address (a Ray actor on another node) and every process sees the same
    numbers. Integer values and array items are read with ``add(key, 0)`` and
    written with ``set``; float values travel as text. ``Semaphore.acquire``
    polls the store (``poll_s``), so a wake costs at most that much latency;
    an array read waits ``read_pause_s`` first, so a writer polling acks in a
    tight loop does not flood the store with round trips. Each process connects
    once per store (lazily, on first use). The store server is the caller's
    (``serve_store``): it must outlive every process that uses the state.
    """

    def __init__(self, host: str, port: int, prefix: str, timeout_s: float = 120.0,
                 poll_s: float = 0.005, read_pause_s: float = 0.001):
        self.host, self.port, self.prefix = host, int(port), prefix
        self.timeout_s, self.poll_s, self.read_pause_s = timeout_s, poll_s, read_pause_s
        self._names = itertools.count()

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_names"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._names = itertools.count()

    def store(self):
        return _client(self.host, self.port, self.timeout_s)

    def _key(self, kind: str) -> str:
        return f"{self.prefix}/{kind}{next(self._names)}"

    def Value(self, typecode: str, init, lock: bool = False) -> StoreValue:
        return StoreValue(self, self._key("value"), typecode, init)

    def Array(self, typecode: str, n: int, lock: bool = False) -> StoreArray:
        if typecode != "q":
            raise ValueError(f"StoreState.Array holds integers (typecode 'q'), not {typecode!r}")
        return StoreArray(self, self._key("array"), n, self.read_pause_s)

    def Semaphore(self, value: int = 0) -> StoreSemaphore:
        return StoreSemaphore(self, self._key("semaphore"), value, self.poll_s)
