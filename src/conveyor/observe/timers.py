"""Wall-clock time per named phase of a training step.

Contract: ``with timer.phase("generate"): ...`` adds the block's wall seconds
(``time.perf_counter``) to that phase's total for the current step, also when
the block raises. ``timer.lap()`` returns ``{"time/<phase>": seconds, ...,
"time/step": seconds since the previous lap}`` and starts the next step.
Names are flat; nested phases each record their own duration, recursion never counts the same
seconds twice (``PhaseTimer`` says how phases nest and span laps).

It deliberately does not know which phases exist, how steps are numbered, or
where the numbers go; the caller passes ``lap()``'s dict to a metrics logger.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PREFIX = "time/"
STEP_KEY = "time/step"


class PhaseTimer:
    """Accumulates seconds per phase between laps; safe to use from several threads.

    Names are flat. Nested phases each record their own full duration, so
    ``train`` wrapping ``train/forward`` reports both, and phase totals may sum to
    more than ``time/step``. Re-entering a phase that is already open (the same
    name nested in itself) records nothing extra, so recursion never counts the
    same seconds twice. A phase still open at ``lap()`` is credited to the step in
    which it closes. ``with timer.outside():`` leaves a block (an evaluation
    between steps) out of the step's time altogether. ``on_span(name, seconds)``,
    when given, hears of every outermost phase as it closes (the run's timeline
    records them as spans).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 on_span: Callable[[str, float], None] | None = None) -> None:
        # The clock is injectable so tests can drive time without sleeping.
        self._clock = clock
        self._on_span = on_span
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}
        self._open: dict[str, int] = {}
        self._lap_start = clock()
        self.outside_s = 0.0  # seconds left out of the steps by ``outside``

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block under ``name``."""
        if not name or name == "step":
            # "step" would collide with the lap total in the returned dict.
            raise ValueError(f"phase name {name!r} is reserved or empty; pick another name")
        with self._lock:
            outermost = self._open.get(name, 0) == 0
            self._open[name] = self._open.get(name, 0) + 1
        start = self._clock()
        try:
            yield
        finally:
            elapsed = self._clock() - start
            with self._lock:
                self._open[name] -= 1
                if outermost:
                    self._totals[name] = self._totals.get(name, 0.0) + elapsed
            if outermost and self._on_span is not None:
                self._on_span(name, elapsed)

    def add(self, name: str, seconds: float) -> None:
        """Credit ``seconds`` measured elsewhere (e.g. by a remote engine) to ``name``."""
        if not name or name == "step":
            raise ValueError(f"phase name {name!r} is reserved or empty; pick another name")
        with self._lock:
            self._totals[name] = self._totals.get(name, 0.0) + float(seconds)

    @contextmanager
    def outside(self) -> Iterator[None]:
        """Leave the ``with`` block's wall time out of the current step (``time/step`` and its
        phases), as for an evaluation between steps; ``outside_s`` sums all such blocks."""
        start = self._clock()
        try:
            yield
        finally:
            with self._lock:
                elapsed = self._clock() - start
                self._lap_start += elapsed
                self.outside_s += elapsed

    def lap(self) -> dict[str, float]:
        """Return this step's phase totals plus ``time/step`` and reset for the next step."""
        now = self._clock()
        with self._lock:
            out = {PREFIX + name: secs for name, secs in self._totals.items()}
            out[STEP_KEY] = now - self._lap_start
            self._totals = {}
            self._lap_start = now
        return out
