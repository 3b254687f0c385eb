"""Ctrl-C during training: the step in progress ends whole, then the run stops.

``deferred(fn)`` wraps the RL loop: while it runs in the main thread, a first SIGINT only asks
it to stop (``requested()`` turns true and a line says so); the loop checks at the end of each
step, saves a checkpoint of that step where checkpoints are on, and raises ``Interrupted`` (a
``KeyboardInterrupt``: the CLI ends with exit 130). A second SIGINT raises at once, as without
the wrapper. Outside the loop (the warm start, an evaluation before it) Ctrl-C is untouched.
A step interrupted in the middle would leave the trainer's weights half updated and its
checkpoint torn; an engine or trainer still inside torch when the interpreter exits aborts
the process. Role processes ignore SIGINT (``procs._bootstrap``): their parent decides.
"""
from __future__ import annotations

import functools
import signal
import sys
import threading

_requested = threading.Event()


class Interrupted(KeyboardInterrupt):
    """The run stopped at a step's end on Ctrl-C."""


def requested() -> bool:
    return _requested.is_set()


def _on_sigint(signum, frame) -> None:
    if _requested.is_set():
        raise KeyboardInterrupt
    _requested.set()
    print("conveyor: Ctrl-C: stopping after the step in progress (and its checkpoint, where checkpoints are "
          "on); Ctrl-C again stops at once", file=sys.stderr, flush=True)


def deferred(fn):
    """``fn`` with a first Ctrl-C deferred to ``requested()`` (main thread only; elsewhere ``fn`` as is)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return fn(*args, **kwargs)  # not ours to change: another thread, or SIGINT handled or ignored
        _requested.clear()
        signal.signal(signal.SIGINT, _on_sigint)
        try:
            return fn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _requested.clear()
    return run
