"""Where was everyone when a wait ran out: stack dumps of every role, and deadlines that adapt.

- ``dump_stacks(what)``: every role's stacks into its log and one line per role saying where
  its main work was, for the error of the wait that ran out. Roles register when they start
  (``register``; ``register_remote`` for a process the controller cannot signal).
- ``child_guard()`` in a role's child: the stack-dump signal, and an exit once the parent is gone.
- ``result(future, timeout_s, what)``: a wait of one role on another; running out is a
  ``RoleError`` naming the wait, with every role's stacks dumped.
- ``Deadlines(base_s)``: a deadline per kind of wait that grows with the longest one seen.

It knows nothing of what the roles do.
"""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

PARENT_POLL_S = 0.5
GROWTH = 4.0
_SETTLE_S = 0.5  # a child writes its dump from a signal handler: give it this long

_roles: "weakref.WeakSet" = weakref.WeakSet()
_remote: dict[str, Callable[[float], str]] = {}
_REMOTE_S = 5.0  # a remote role's dump: an actor whose every thread is stuck does not answer
_log_dir: Path | None = None


def configure(log_dir: Path) -> None:
    """Where this process's own stack dumps go (the run's ``logs/``)."""
    global _log_dir
    _log_dir = Path(log_dir)


def register(role) -> None:
    """A started ``RoleProcess`` (anything with ``role``, ``proc`` and ``log_path``)."""
    _roles.add(role)
    global _log_dir
    if _log_dir is None:
        _log_dir = Path(role.log_path).parent


def register_remote(role: str, fetch: Callable[[float], str]) -> None:
    """A role whose stacks come back from ``fetch(timeout_s)``.

    A role in a process the controller cannot signal (a Ray actor) registers
    with ``register_remote(role, fetch)``: ``fetch(timeout_s)`` returns that
    process's dump (``own_stacks()`` run there); ``dump_stacks`` appends it to
    ``<log dir>/<role>.stacks.log`` and reports it like the others.
    ``unregister_remote(role)`` when the role is stopped.
    """
    _remote[role] = fetch


def unregister_remote(role: str) -> None:
    _remote.pop(role, None)


def own_stacks() -> str:
    """Every thread's stack in this process, as ``faulthandler`` writes it."""
    import tempfile
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def child_guard() -> None:
    """In a role's child process: dump stacks on SIGUSR1, exit when the parent is gone.

    ``child_guard()`` runs in a role's child: the stack-dump signal, and a thread
    that ends the child when its parent is gone (a controller killed with
    SIGKILL leaves no role process behind; the child notices within
    ``PARENT_POLL_S``).
    """
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:  # re-parented: the controller is gone
                os._exit(70)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def dump_stacks(what: str) -> str:
    """Dump every role's and this process's stacks; return where each role was, one line each.

    Every role process (``procs.RoleProcess``) registers here when it starts and
    installs ``faulthandler`` on ``SIGUSR1`` in the child, writing every
    thread's stack to its own log. ``dump_stacks(what)`` asks every live role
    process for that dump, writes this process's threads to
    ``<log dir>/controller.log`` and returns one line per role saying where its
    main work was (the innermost frame of each thread that is not idle), for the
    error of the wait that ran out. The controller calls it before it raises a
    deadline error, so the error names the wait and the other side's place.
    """
    live = [r for r in list(_roles) if r.proc.is_alive() and r.proc.pid]
    sizes = {}
    for r in live:
        try:
            sizes[r.role] = Path(r.log_path).stat().st_size
            os.kill(r.proc.pid, signal.SIGUSR1)
        except OSError:
            pass
    own = ""
    if _log_dir is not None:
        _log_dir.mkdir(parents=True, exist_ok=True)
        path = _log_dir / "controller.log"
        with open(path, "a") as f:
            f.write(f"\n[controller] {time.strftime('%H:%M:%S')} stacks of every thread: {what}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        own = f"controller: stacks in {path}"
    time.sleep(_SETTLE_S if live else 0.0)
    lines = [own] if own else []
    for r in live:
        where = _where(_read_from(Path(r.log_path), sizes.get(r.role, 0)))
        lines.append(f"{r.role} (pid {r.proc.pid}): {where or 'no stack written'}; stacks in {r.log_path}")
    lines.extend(_remote_line(role, fetch, what) for role, fetch in list(_remote.items()))
    return "\n".join(lines)


def result(future, timeout_s: float, what: str):
    """``future.result(timeout_s)``; running out is a ``RoleError`` with every role's stacks.

    ``result(future, timeout_s, what)``: ``future.result(timeout_s)`` for a wait of
    one role on another (an evaluation, a batch of episodes, an agent server's
    start); one that runs out is a ``RoleError`` saying what did not finish in
    how long, with every role's stacks dumped and where each was (a raw
    ``TimeoutError`` named nothing). tests/unit/runtime/test_watchdog.py lists
    every other ``.result(timeout=...)`` in the code and why it may wait alone.
    """
    from conveyor.runtime.errors import RoleError
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:  # concurrent.futures' and asyncio's TimeoutError are this one
        raise RoleError(f"{what} did not finish within {timeout_s:g}s (launch.timeout_s)\nwhere each role was:\n"
                        f"{dump_stacks(what)}") from None


def _remote_line(role: str, fetch: Callable[[float], str], what: str) -> str:
    try:
        dump = fetch(_REMOTE_S)
    except Exception as e:  # noqa: BLE001 - a dead or stuck actor: say so in its line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"{role}: no stacks ({type(e).__name__}: {first})"
    if _log_dir is None:
        return f"{role}: {_where(dump) or 'no stack'}"
    _log_dir.mkdir(parents=True, exist_ok=True)
    path = _log_dir / f"{role}.stacks.log"
    with open(path, "a") as f:
        f.write(f"\n[{role}] {time.strftime('%H:%M:%S')} stacks of every thread: {what}\n{dump}")
    return f"{role}: {_where(dump) or 'no stack'}; stacks in {path}"


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


_IDLE = {"threading.py", "queues.py", "selectors.py", "connection.py", "watchdog.py", "tempfile.py"}


def _where(dump: str) -> str:
    """The innermost frame of each thread of a faulthandler dump whose top is not a wait of the
    standard library (idle helper threads), joined; threads running this package's code come
    first (a Ray worker's own threads are idle in Ray); else the main thread's top frame."""
    ours: list[str] = []
    other: list[str] = []
    first = ""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
        m = re.search(r'File "([^"]+)", line (\d+) in (\S+)', block)
        if not m:
            continue
        path, line, fn = m.groups()
        frame = f"{fn} ({Path(path).name}:{line})"
        first = first or frame
        if Path(path).name not in _IDLE:
            (ours if f"{os.sep}conveyor{os.sep}" in block else other).append(frame)
    return ", ".join((ours + other)[:3]) or first


class Deadlines:
    """Per-kind deadlines that grow with what was seen.

    ``Deadlines(base_s)``: the deadline of a wait of some kind is the larger of
    ``base_s`` (``launch.timeout_s``) and ``GROWTH`` times the longest wait of
    that kind that completed, so a stuck run stops within minutes while a
    model whose steps legitimately take long is not cut.
    """

    def __init__(self, base_s: float, growth: float = GROWTH):
        self.base_s, self.growth = float(base_s), growth
        self._longest: dict[str, float] = {}
        self._lock = threading.Lock()

    def of(self, kind: str) -> float:
        with self._lock:
            return max(self.base_s, self.growth * self._longest.get(kind, 0.0))

    def observe(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._longest[kind] = max(self._longest.get(kind, 0.0), seconds)
