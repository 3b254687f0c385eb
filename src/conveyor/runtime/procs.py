"""Child processes for roles: start, call with deadlines, notice death, stop.

- ``RoleProcess`` starts ``target(*args)`` in a spawned process named after the role, logging to
  ``log_dir/<role>.log`` (or as a standby until ``take_over()``); ``check()`` raises
  ``RoleError`` (``runtime.errors.RoleError``) if it died, naming the role, its exit code and
  its log's last lines.
- ``RpcClient`` calls methods of an object ``serve_rpc`` serves in the child; every call has a
  deadline, and the child's exception comes back as ``RoleError`` with its traceback.
- ``call_all`` calls several children at once; the first that raises or dies ends the call.
- ``Call`` / ``Answer`` travel as ``dumps``/``loads`` bytes, CPU tensors as their raw bytes.
- ``bind_device(device)``: the first thing a role's child main does.

It knows nothing of what the roles do.
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from conveyor.runtime import watchdog
from conveyor.runtime.errors import RoleError


@dataclass(frozen=True)
class Call:
    """Call ``method(*args, **kwargs)`` on the object a child serves; method ``"__stop__"`` ends it."""
    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """What a ``Call`` returned (``ok``) or the child's traceback (not ``ok``)."""
    ok: bool
    value: Any = None


def _tensor(raw: bytes, dtype, shape: tuple) -> Any:
    import torch
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad:
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor, (raw, obj.dtype, tuple(obj.shape))
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """Calls and answers (``Call`` / ``Answer``, defined here and listed with every
    other message in ``transport.messages``) travel as ``dumps``/``loads`` bytes
    in which CPU tensors are their raw bytes, not a shared-memory file per
    tensor as torch's default reduction would make.
    """
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def _log_to(path: str, first: bool = True) -> None:
    """This process's stdout and stderr (the file descriptors too) append to ``path``; ``first``:
    the streams are made line-buffered over them (later calls only move the descriptors)."""
    if not first:
        sys.stdout.flush()
        sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if first:
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)


def _standby_log(log_path: str) -> str:
    return log_path[:-len(".log")] + ".standby.log"


def _bootstrap(role: str, log_path: str, threads: int, target: Callable, args: tuple,
               prepare: Callable | None = None, go=None) -> None:
    _log_to(log_path if go is None else _standby_log(log_path))
    from conveyor.runtime.watchdog import child_guard
    child_guard()  # stacks on SIGUSR1 into this log; gone with the controller
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's group: the parent decides
    import torch
    torch.set_num_threads(max(1, threads))
    try:
        if go is not None:
            print(f"[{role}] standby pid={os.getpid()}: preparing to replace {role} if it dies", flush=True)
            prepare(*args)
            print(f"[{role}] standby ready", flush=True)
            # Until its owner needs it or stops it (child_guard ends it with the controller). A
            # semaphore, not an Event: a standby killed while waiting leaves no lock held.
            go.acquire()
            _log_to(log_path, first=False)
            print(f"[{role}] taking over from its standby process", flush=True)
        print(f"[{role}] started pid={os.getpid()} threads={threads}", flush=True)
        target(*args)
    except BaseException:  # noqa: BLE001 - the log is the only place a child can report to
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(f"[{role}] exiting", flush=True)


class RoleProcess:
    """- ``RoleProcess(role, target, args, log_dir, ctx, threads)`` starts
      ``target(*args)`` in a spawned process named after the role, with its
      stdout/stderr going to ``log_dir/<role>.log`` and torch limited to
      ``threads`` threads. With ``prepare`` it is a standby: the child runs
      ``prepare(*args)`` (imports, nothing that holds a device or a shared
      resource), logging to ``log_dir/<role>.standby.log``, then waits until
      ``take_over()``; from then on it logs to ``<role>.log`` like any other
      start (its ``started pid=`` line) and runs ``target(*args)``. A standby
      never needed is ended by ``stop()``.
    - ``check()`` raises ``RoleError`` if the process has died, naming the role,
      its exit code and the last lines of its log; the controller calls it
      whenever it waits, so a dead child is noticed within a poll interval.
    """
    def __init__(self, role: str, target: Callable, args: tuple, log_dir: Path, ctx, threads: int = 1,
                 prepare: Callable | None = None):
        self.role = role
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{role}.log"
        self._go = ctx.Semaphore(0) if prepare is not None else None
        self._log = log  # where it logs once it runs ``target``
        self.log_path = log if prepare is None else Path(_standby_log(str(log)))
        self.proc = ctx.Process(target=_bootstrap, name=role, daemon=True,
                                args=(role, str(log), threads, target, args, prepare, self._go))
        self.proc.start()
        watchdog.register(self)

    def take_over(self) -> None:
        """A standby starts ``target`` (see ``RoleProcess``); nothing for a process that runs it."""
        if self._go is not None:
            self._go.release()
            self._go, self.log_path = None, self._log

    def last_lines(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def check(self) -> None:
        if not self.proc.is_alive():
            raise RoleError(f"{self.role} process exited with code {self.proc.exitcode}; "
                            f"last lines of {self.log_path}:\n{self.last_lines()}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.is_alive():
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3.0)


def bind_device(device: str) -> None:
    """Make ``device`` this process's GPU ("cuda" in a role's config then means it); CPU: nothing."""
    import torch
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def serve_rpc(obj: Any, conn) -> None:
    """Child side: answer each ``Call`` until one of method ``"__stop__"``."""
    while True:
        call: Call = loads(conn.recv_bytes())
        if call.method == "__stop__":
            conn.send_bytes(dumps(Answer(True)))
            return
        try:
            answer = dumps(Answer(True, getattr(obj, call.method)(*call.args, **call.kwargs)))
        except Exception:  # noqa: BLE001 - sent back to the caller with the traceback
            answer = dumps(Answer(False, traceback.format_exc()))
        conn.send_bytes(answer)


class RpcClient:
    """``RpcClient(conn, proc)`` calls methods of an object served by
    ``serve_rpc(obj, conn)`` in the child: every call has a deadline, and an
    exception in the child comes back as ``RoleError`` carrying the child's
    traceback. ``stop()`` asks politely, then terminates, then kills.
    """
    def __init__(self, conn, proc: RoleProcess, poll_s: float = 0.2):
        self.conn, self.proc, self.poll_s = conn, proc, poll_s

    def call(self, method: str, *args, timeout: float = 600.0, **kwargs) -> Any:
        return call_all([self], method, args, kwargs, timeout)[0]

    def stop(self) -> None:
        try:
            if self.proc.proc.is_alive():
                self.call("__stop__", timeout=10.0)
        except (RoleError, OSError, EOFError):
            pass
        self.proc.stop()


def call_all(clients: list[RpcClient], method: str, args: tuple, kwargs: dict, timeout: float,
             failed: Callable[[], BaseException | None] | None = None) -> list[Any]:
    """``call_all(clients, method, args, kwargs, timeout)`` calls the same method
    on several children at once (ranks that run a collective together) and
    returns their answers in order; the first child that raises or dies ends
    the call with its error, without waiting for the others (which may be
    blocked in a collective with it). A call past its deadline dumps every
    role's stacks (``watchdog.dump_stacks``) and its error says where each
    role was. With ``failed`` (a probe of the run's other roles: their first
    error, or None) the call also stops as soon as another role has failed,
    with that role's error (``stop_for``): a trainer waiting on a dead
    engine's weight receipt would otherwise run out later and hide it.
    """
    message = dumps(Call(method, tuple(args), dict(kwargs)))
    for c in clients:
        c.proc.check()
        c.conn.send_bytes(message)
    answers: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    # One client can block in poll; several are polled in turn so that any one's failure is seen.
    wait = clients[0].poll_s if len(clients) == 1 else 0.01
    while len(answers) < len(clients):
        for i, c in enumerate(clients):
            if i in answers:
                continue
            if not c.conn.poll(wait):
                c.proc.check()
                continue
            answer = _receive(c.conn, c.proc, method)
            if not answer.ok:
                _peer_died(clients)  # a rank whose peer died fails in its collective: name the death
                raise RoleError(f"{c.proc.role}.{method} raised in the {c.proc.role} process:\n{answer.value}")
            answers[i] = answer.value
        late = [c for i, c in enumerate(clients) if i not in answers]
        if not late:
            break
        what = f"{', '.join(c.proc.role for c in late)}.{method}"
        if failed is not None:
            stop_for(failed(), what)
        if time.monotonic() > deadline:
            where = watchdog.dump_stacks(f"{what} did not answer within {timeout:g}s")
            raise RoleError(f"{what} did not answer within {timeout:g}s (launch.timeout_s); where each "
                            f"role was:\n{where}")
    return [answers[i] for i in range(len(clients))]


def stop_for(error: BaseException | None, what: str, doing: str = "was running") -> None:
    """Raise ``error`` (another role's failure) as the run's error if there is one: a call that waits
    on a role which waits on the failed one would otherwise run out later and hide the cause."""
    if error is not None:
        raise RoleError(f"{error}\n(the run stopped while {what} {doing})") from error


def _peer_died(clients: list[RpcClient], grace_s: float = 1.0) -> None:
    """Raise the exit of any of ``clients``' processes, waiting up to ``grace_s`` for one to be
    reaped (no wait with a single client: there is no peer)."""
    deadline = time.monotonic() + (grace_s if len(clients) > 1 else 0.0)
    while True:
        for c in clients:
            c.proc.check()
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _receive(conn, proc: RoleProcess, method: str) -> Answer:
    """The answer; a pipe that breaks means the child died: report that, with its exit code."""
    try:
        return loads(conn.recv_bytes())
    except (EOFError, OSError) as e:
        proc.proc.join(5.0)  # let the death be reaped so the exit code is known
        proc.check()
        raise RoleError(f"{proc.role}.{method}: lost the connection to the {proc.role} process ({e}); "
                        f"last lines of {proc.log_path}:\n{proc.last_lines()}") from None
