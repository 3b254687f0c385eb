"""Small network helpers shared by the servers conveyor starts (the OpenAI-compatible endpoint,
the reward server)."""
from __future__ import annotations

import socket


def listen(host: str, port: int) -> socket.socket:
    """A non-blocking socket bound to ``host:port`` (port 0: the system picks a free one), ready to
    hand to uvicorn; raises ``OSError`` when the address cannot be had."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
