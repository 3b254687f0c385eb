"""StoreState: counters in a TCPStore behave like multiprocessing's shared ones, across processes."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import time

import pytest

from conveyor.transport.store_state import StoreState, serve_store


@pytest.fixture
def state():
    server = serve_store("127.0.0.1", 30.0)
    yield StoreState("127.0.0.1", server.port, "test", timeout_s=30.0)
    del server


def _child(state: StoreState, value, array, sem, out) -> None:
    out.put((value.value, array[1]))
    value.value = 7
    array[2] = 99
    sem.release()
    sem.release()


def test_values_arrays_and_semaphores_are_shared_with_another_process(state):
    value, stamp = state.Value("q", 3, lock=False), state.Value("d", 0.0, lock=False)
    array, sem = state.Array("q", 3, lock=False), state.Semaphore(0)
    array[1] = 5
    stamp.value = 1.25
    assert (value.value, stamp.value, list(array[i] for i in range(3)), len(array)) == (3, 1.25, [0, 5, 0], 3)
    assert not sem.acquire(block=False) and not sem.acquire(timeout=0.05)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_child, args=(state, value, array, sem, out))
    p.start()
    assert out.get(timeout=60) == (3, 5)  # the child read what this process wrote
    p.join(60)
    assert p.exitcode == 0
    assert value.value == 7 and array[2] == 99  # and this process reads what it wrote
    assert sem.acquire(timeout=5) and sem.acquire(timeout=5) and not sem.acquire(block=False)


def test_objects_pickle_by_address_and_reject_misuse(state):
    value = state.Value("q", 11)
    again = pickle.loads(pickle.dumps(value))
    again.value = 12
    assert value.value == 12
    array = state.Array("q", 2)
    with pytest.raises(IndexError, match=r"out of range 0\.\.1"):
        array[2]
    with pytest.raises(ValueError, match="holds integers"):
        state.Array("d", 2)


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_acquire_waits_no_longer_than_its_timeout(state):
    sem = state.Semaphore(0)
    t0 = time.monotonic()
    assert not sem.acquire(timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 10.0  # returns at its timeout; a loaded machine only adds a little
