"""A direct TCP channel between the Ray driver and one actor: pickled messages, in order, both ways.

Contract: in the actor, ``serve(inbox, outbox, authkey)`` listens and accepts ONE connection
(only the driver that asked can connect); in the driver, ``connect(address, authkey)`` returns a
``Channel`` whose ``recv()`` raises once the actor's end is gone. Messages are pickled with
the standard pickler, never with torch's shared-memory reductions (which cannot cross nodes).
Measured against actor calls in ``benchmarks/ray_channels.py`` (docs/cluster.md, "Data over Ray").

It knows nothing of what the messages mean.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import threading
from multiprocessing.connection import Client, Connection, Listener


def _nodelay(conn: Connection) -> Connection:
    s = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        s.close()
    return conn


class Channel:
    """The driver's end.

    ``connect(address, authkey)`` returns
    a ``Channel``: ``send(message)`` (thread-safe), ``recv()`` (blocks; raises
    ``EOFError`` / ``OSError`` when the actor's end is gone, which is how the
    driver learns of its death within the socket's close), ``close()``.
    Messages are pickled with the standard pickler (protocol 5), never with
    torch's shared-memory reductions (which cannot cross nodes); Nagle's delay
    is off (measured against actor calls in ``benchmarks/ray_channels.py``,
    docs/cluster.md, "Data over Ray").
    """

    def __init__(self, conn: Connection):
        self._conn = _nodelay(conn)
        self._lock = threading.Lock()

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=5)
        with self._lock:
            self._conn.send_bytes(data)

    def recv(self):
        return pickle.loads(self._conn.recv_bytes())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.close()


def connect(address: tuple[str, int], authkey: bytes) -> Channel:
    """Connect to an actor's ``serve`` (refused at once when nothing listens there any more)."""
    return Channel(Client(tuple(address), authkey=authkey))


def serve(inbox: queue.Queue, outbox: queue.Queue, authkey: bytes, host: str) -> tuple[str, int]:
    """In the actor: listen on ``host``, serve one connection in threads.

    Contract: in the actor, ``serve(inbox, outbox, authkey)`` listens on the
    actor's node address (a port the system picks), returns that ``(host,
    port)`` at once and, in threads of its own, accepts ONE connection (with
    ``authkey``: only the driver that asked can connect), then puts every
    message received into ``inbox`` and sends everything put into ``outbox``
    (also what was put before the driver connected), until the connection
    closes.
    """
    listener = Listener((host, 0), authkey=authkey)

    def run() -> None:
        with listener:
            conn = _nodelay(listener.accept())
        chan = Channel(conn)

        def write() -> None:
            while True:
                message = outbox.get()
                try:
                    chan.send(message)
                except OSError:
                    return
        threading.Thread(target=write, name="channel-out", daemon=True).start()
        while True:
            try:
                inbox.put(chan.recv())
            except (EOFError, OSError):
                return
    threading.Thread(target=run, name="channel-in", daemon=True).start()
    return listener.address
