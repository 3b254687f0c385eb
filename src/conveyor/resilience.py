"""Failure handling shared by the parts that call out to something that may fail: a circuit
breaker and retry delays.

- ``Breaker(failures, cooldown_s, label)``: per key, after ``failures`` consecutive failures the
  key is open for ``cooldown_s``, then ONE trial call decides. Thread-safe.
- ``backoff_delay(attempt, base_s, cap_s, rng)``: exponential backoff with full jitter, so
  clients that failed together do not retry together.

It knows nothing of what is called: the environment pool (``env/pool.py``) and the remote
reward client (``reward/remote.py``) decide what a failure is and what to do instead.
"""
from __future__ import annotations

import logging
import random
import threading
import time

log = logging.getLogger(__name__)


class Breaker:
    """Consecutive-failure circuit breaker per key.

    ``Breaker(failures, cooldown_s, label)``: per key (a tool's name, ``"env"``, a server's
    URL), after ``failures`` consecutive failures recorded with ``record(key, False)`` the key
    is open for ``cooldown_s``: ``allow(key)`` says False. Once the cooldown has passed,
    ``allow`` lets ONE trial call through (and keeps the key open for another cooldown until
    that trial's result is recorded); ``record(key, True)`` closes it. ``open_keys()`` names
    the open keys. Opening and closing are logged once each, prefixed with ``label``. Thread-safe.
    """

    def __init__(self, failures: int, cooldown_s: float, label: str = "breaker"):
        self.failures, self.cooldown_s, self.label = failures, cooldown_s, label
        self._streak: dict[str, int] = {}
        self._open_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        """Whether a call may go through: closed, or open past its cooldown (the trial call)."""
        with self._lock:
            until = self._open_until.get(key)
            if until is None:
                return True
            if time.monotonic() >= until:
                # One trial: keep it open (for a new cooldown) until the trial's result is recorded.
                self._open_until[key] = time.monotonic() + self.cooldown_s
                return True
            return False

    def record(self, key: str, ok: bool) -> None:
        with self._lock:
            if ok:
                self._streak[key] = 0
                if self._open_until.pop(key, None) is not None:
                    log.warning("%s: %s works again; quarantine lifted", self.label, key)
                return
            self._streak[key] = self._streak.get(key, 0) + 1
            if self._streak[key] >= self.failures and key not in self._open_until:
                self._open_until[key] = time.monotonic() + self.cooldown_s
                log.warning("%s: %s failed %d times in a row; quarantined for %.0fs",
                            self.label, key, self._streak[key], self.cooldown_s)

    def open_keys(self) -> list[str]:
        with self._lock:
            return sorted(self._open_until)


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): full jitter over an exponential bound.

    ``backoff_delay(attempt, base_s, cap_s, rng)``: the wait before retry ``attempt`` (0 for the
    first retry): exponential backoff with full jitter, uniform in
    ``[0, min(cap_s, base_s * 2**attempt)]``, so clients that failed together do not retry
    together.
    """
    bound = min(cap_s, base_s * (2 ** attempt))
    return (rng or random).uniform(0.0, bound)
