"""A reward worker process: loads its reward, scores on its main thread, dies with its parent.

- ``WorkerProcess(ctx, spec, fallback, name)`` starts one and is its parent's handle;
  ``worker_main`` is that process's main: load the reward, then answer each ``ScoreRequest``
  checked, never raising, until ``None`` or the pipe closes.
- The worker leads a process group of its own (a kill takes what the reward started with it),
  ignores SIGINT and exits when its parent is gone.
- ``load``, ``answer`` and ``unpicklable``: that loading and scoring, shared with the reward
  workers that run as Ray actors (``launch/ray_rewards.py``).

It knows nothing of deadlines, queues or counters: ``processes.py`` owns them.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from conveyor.plugins import PluginError
from conveyor.reward.api import BatchReward, reward_name
from conveyor.reward.batching import call_checked
from conveyor.reward.calls import Outcome, Problem, call_reward
from conveyor.transport.messages import RewardLoaded, ScoreReply

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.reward.factory import RewardSpec

_PARENT_POLL_S = 0.2  # how often the watcher looks for its parent


class WorkerProcess:
    """The parent's handle of one worker process.

    Contract: ``WorkerProcess(ctx, spec, fallback, name)`` starts one (its
    parent's handle: ``conn``, ``sentinel``, ``ask_to_exit``, ``join``, ``end``
    to kill it with its process group and reap it, returning its exit code;
    ``exit_text(code)`` says it in words). ``worker_main(spec, conn, parent_pid,
    fallback)`` is the main of that process. It loads the reward
    from ``spec`` (``factory.RewardSpec.load``) and answers ``RewardLoaded``
    (with a one-line ``error`` if it cannot; with its ``max_batch`` if it is a
    ``BatchReward``, such as a reward model the worker builds on its own device);
    then, for each ``ScoreRequest`` received on ``conn``, it calls the reward on
    its main thread (``calls.call_reward`` on the one trajectory, or
    ``batching.call_checked`` on the batch: checked, never raising) and answers
    ``ScoreReply``, until it receives ``None`` or the pipe closes; then it closes
    a batched reward. It leads a process group of
    its own (a kill at a deadline takes what the reward started with it),
    ignores SIGINT (its parent decides when it stops), and exits when its parent
    process is gone: the kernel's parent-death signal (Linux) and a thread that
    watches its parent's pid.
    """

    def __init__(self, ctx, spec: RewardSpec, fallback: float, name: str) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker_main, name=name, daemon=True,
                                args=(spec, child_conn, os.getpid(), fallback))
        self.proc.start()
        child_conn.close()  # the child holds its end: EOF here when it dies
        self.sentinel = self.proc.sentinel

    def ask_to_exit(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass

    def join(self, timeout_s: float) -> None:
        self.proc.join(max(0.0, timeout_s))

    def end(self) -> int | None:
        if self.proc.is_alive():
            try:  # the worker leads its own process group: what it started goes too
                if os.getpgid(self.proc.pid) == self.proc.pid:
                    os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()
        code = self.proc.exitcode
        if code is not None:
            self.proc.close()  # frees its sentinel now rather than at garbage collection
        return code


def exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code (still running after SIGKILL)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def worker_main(spec: RewardSpec, conn, parent_pid: int, fallback: float) -> None:
    """Load the reward, then answer each ``ScoreRequest`` until ``None`` or the pipe closes."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's group; the parent decides
    try:
        os.setpgid(0, 0)  # lead a group of its own, so a kill at the deadline takes what the reward started
    except OSError:
        pass
    if "torch" in sys.modules:  # one intra-op thread per worker: the pool is the parallelism (a
        sys.modules["torch"].set_num_threads(1)  # model's batch on 2 threads per worker ran 50x slower)
    fn, loaded = load(spec)
    conn.send(loaded)
    if fn is None:
        return
    batched = isinstance(fn, BatchReward)
    try:
        _serve(fn, batched, loaded.name, conn, fallback)
    finally:
        if batched:
            with contextlib.suppress(Exception):  # the process ends next: nothing to tell
                fn.close()


def load(spec: RewardSpec):
    """The reward of ``spec`` and its ``RewardLoaded`` report (the reward is None, the report's
    ``error`` one line, when it cannot load)."""
    try:
        fn = spec.load()
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return None, RewardLoaded(os.getpid(), error=msg if isinstance(e, PluginError) else f"{type(e).__name__}: {msg}")
    batched = isinstance(fn, BatchReward)
    name = fn.name if batched else reward_name(fn)
    return fn, RewardLoaded(os.getpid(), name, max_batch=fn.max_batch if batched else 0)


def answer(fn, batched: bool, name: str, req, fallback: float) -> ScoreReply:
    """Score one ``ScoreRequest`` (checked: never raising) into its ``ScoreReply``."""
    start = time.time()
    if batched:
        outs = call_checked(fn, req.trajs, name, fallback)
    else:
        outs = [call_reward(fn, req.trajs[0], name, fallback)]
    outs = tuple(dataclasses.replace(o, problem=o.problem.portable()) if o.problem else o for o in outs)
    return ScoreReply(req.seq, outs, start, time.time())


def unpicklable(reply: ScoreReply, name: str, fallback: float, e: Exception) -> ScoreReply:
    """``reply`` with every outcome the fallback, for a result that cannot be sent to the controller."""
    out = Outcome(fallback, {"reward_error": "unpicklable result"}, "failures", Problem(
        "unpicklable", f"reward {name!r} returned a result that cannot be sent to the controller "
        f"({type(e).__name__}: {e}); keep its dict to numbers and strings; using fallback {fallback}"))
    return dataclasses.replace(reply, outcomes=(out,) * len(reply.outcomes), ended_at=time.time())


def _serve(fn, batched: bool, name: str, conn, fallback: float) -> None:
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        if req is None:
            return
        reply = answer(fn, batched, name, req, fallback)
        try:
            conn.send(reply)
        except (OSError, EOFError):
            return
        except Exception as e:  # noqa: BLE001 - the reward's info did not pickle
            conn.send(unpicklable(reply, name, fallback, e))


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:  # PR_SET_PDEATHSIG: the kernel kills us when the thread that started us ends
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before we could watch it
        os._exit(0)

    def watch() -> None:  # also where the signal is not available, or the GIL is held in C for long
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
