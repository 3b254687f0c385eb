"""Engine workers and trainer ranks as Ray actors, and the controller's handles on them.

- ``EngineActor`` builds one engine and serves it with ``rollout.serve.engine_loop``, connected
  to the controller by a direct TCP channel (``ray_channel``); ``RayWorker`` is the
  ``EngineWorker`` (``rollout/api.py``) over one such actor, restartable in place.
- ``WarmWeights``: the controller's warm-start weights through the object store, applied by
  each actor's ``ActorWarmReader``.
- ``TrainerRankActor`` is one trainer rank; ``RayTrainerProxy`` is ``launch.roles.TrainerProxy``
  over those actors.
- A dead actor or a rank that raises is a ``RoleError`` naming it, its node and pid.

It knows nothing of placement groups (``launch/ray.py`` places the actors)
or of the loop.
"""
from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import ray

from conveyor.launch.roles import TrainerProxy
from conveyor.runtime import watchdog
from conveyor.runtime.procs import RoleError, stop_for
from conveyor.transport.messages import Answer, Failed, Ready

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.trainer.serve import RankSpec


@dataclass(frozen=True)
class Place:
    """Where an actor runs: its node's address, Ray node id and host name, and its pid."""
    node: str
    node_id: str
    host: str
    pid: int

    def __str__(self) -> str:
        return f"node {self.node} ({self.host}, Ray node {self.node_id[:12]}), pid {self.pid}"


_SLICE_S = 0.5  # a trainer's start or call looks at the run's other roles this often


def get_unless_failed(ref, timeout: float, failed: Callable[[], BaseException | None], what: str):
    """``ray.get(ref, timeout=timeout)``, but another role's failure (``failed()``) stops the wait
    at once as the run's error (``procs.stop_for``): ``what`` was starting meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        done, _ = ray.wait([ref], timeout=max(0.0, min(_SLICE_S, deadline - time.monotonic())))
        if done or time.monotonic() >= deadline:
            return ray.get(ref, timeout=0)  # its answer, its error, or GetTimeoutError
        stop_for(failed(), what, "was starting")


UNKNOWN = Place("?", "?", "?", -1)  # an actor that died before it said where it was


def where() -> Place:
    """This process's place."""
    return Place(ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), socket.gethostname(),
                 os.getpid())


@ray.remote(max_concurrency=4)
class EngineActor:
    """``EngineActor(spec, reader, engine_id, partial)`` builds one engine (in a
    thread, so the actor answers while it loads) and serves it with
    ``rollout.serve.engine_loop`` over in-actor queues, which
    ``channel(authkey)`` connects to the controller by a direct TCP channel
    (``ray_channel``: ``Generate`` / ``Stop`` in, answers out, in order; a
    message costs the driver a twentieth of an actor call's CPU, docs/cluster.md).
    """
    def __init__(self, spec: dict, reader, engine_id: int, partial: bool):
        import sys

        import torch
        torch.set_num_threads(max(1, spec["threads"]))
        # The weight receiver must get the GIL from the decode loop quickly (as in engine_process).
        sys.setswitchinterval(0.0005)
        from conveyor.transport.weights import Fanin
        self._warm = ActorWarmReader()
        reader = Fanin([self._warm, reader])
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, args=(spec, reader, engine_id, partial),
                                        name=f"engine{engine_id}", daemon=True)
        self._thread.start()

    def _serve(self, spec: dict, reader, engine_id: int, partial: bool) -> None:
        from conveyor.config import RolloutConfig
        from conveyor.rollout.factory import make_engine
        from conveyor.rollout.serve import engine_loop
        from conveyor.runtime.procs import bind_device
        try:
            bind_device(spec["device"])
            engine = make_engine(RolloutConfig.model_validate(spec["rollout"]), spec["path"])
            reader.poll(engine, engine_id)
            self._outbox.put(Ready(engine_id, engine.context_limit, engine.label))
        except Exception:  # noqa: BLE001 - reported to the controller, which stops the run
            self._outbox.put(Failed(engine_id, traceback.format_exc()))
            return
        engine_loop(engine, self._inbox, self._outbox, reader, engine_id, partial, spec["timeout_s"])

    def where(self) -> Place:
        return where()

    def warm(self, named: dict, version: int) -> None:
        self._warm.take(named, version)

    def stacks(self) -> str:
        """Every thread's stack (``runtime.watchdog``: a wait that ran out says where this actor was)."""
        from conveyor.runtime.watchdog import own_stacks
        return own_stacks()

    def channel(self, authkey: bytes) -> tuple[str, int]:
        """Open the controller's channel: messages in, answers out (``ray_channel.serve``)."""
        from conveyor.launch.ray_channel import serve
        return serve(self._inbox, self._outbox, authkey, ray.util.get_node_ip_address())

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


class ActorWarmReader:
    """A ``WeightReader`` of the warm-start weights an engine actor was handed (see ``WarmWeights``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: tuple[dict, int] | None = None
        self._version = -1
        self.received_at: float | None = None
        self.announced_at: float | None = None

    @property
    def version(self) -> int:
        return self._version

    def take(self, named: dict, version: int) -> None:
        with self._lock:
            self._pending, self.received_at = (named, int(version)), time.time()
            self.announced_at = self.received_at

    def wait_news(self, engine, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._pending is None and time.monotonic() < deadline:
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
        return self._pending is not None

    def poll(self, engine, engine_id: int = 0) -> int | None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        named, version = pending
        engine.update_weights(list(named.items()), version)
        self._version = version
        return version


class WarmWeights:
    """The controller's warm-start publish to every engine actor.

    ``WarmWeights`` is where the controller publishes warm-start weights
    (``Engines.warm``): ``publish(named_tensors, version)`` puts them in the
    object store once and returns when every engine actor holds them; each
    actor's ``ActorWarmReader`` (a ``WeightReader``, polled before the
    broadcast through ``Fanin``) applies them at the engine's next poll.
    """

    def __init__(self, actors: Callable[[], list], names: list[str], timeout_s: float):
        self._actors, self._names, self._timeout = actors, set(names), timeout_s  # actors(): the live ones

    def publish(self, named_tensors, version: int) -> None:
        named = {n: t.detach().to("cpu", copy=True) for n, t in named_tensors if n in self._names}
        missing = self._names - named.keys()
        if missing:
            raise KeyError(f"warm-start publish of version {version}: missing tensors {sorted(missing)[:3]}")
        ref = ray.put(named)
        ray.get([a.warm.remote(ref, version) for a in self._actors()], timeout=self._timeout)


class RayWorker:
    """The ``EngineWorker`` over an ``EngineActor``.

    ``RayWorker`` is the ``EngineWorker`` (``rollout/api.py``) over one such
    actor: ``locate`` opens the channel, a driver thread moves its answers into
    the shared outbox; ``check`` raises ``RoleError`` naming the engine, its
    node and pid and Ray's error once the actor is dead (its channel closes
    when its process goes).
    ``restart()`` (the producer's, for a dead actor) makes a new actor placed
    like the dead one (``make``), after ``regroup`` (``BroadcastWeights.regroup``):
    the weight broadcast group re-forms with it and the trainer sends it the
    current version; ``placed`` records where it runs.
    """

    restartable = True

    def __init__(self, engine_id: int, make: Callable[[], object], outbox: queue.Queue,
                 regroup: Callable[[], int], placed: Callable[[Place], None], timeout_s: float):
        self.engine_id, self._make, self._outbox = engine_id, make, outbox
        self._regroup, self._placed, self._timeout = regroup, placed, timeout_s
        self.actor = make()
        self._channel = None
        self._error: str | None = None
        self.place = UNKNOWN
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restarts = 0

    def locate(self, timeout: float) -> Place:
        """Where the actor runs; opens its channel and starts relaying its answers."""
        from conveyor.launch.ray_channel import connect
        self.place = ray.get(self.actor.where.remote(), timeout=timeout)
        key = os.urandom(32)
        self._channel = connect(ray.get(self.actor.channel.remote(key), timeout=timeout), key)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay, args=(self._channel, self._stop),
                                        name=f"engine{self.engine_id}-ray-relay", daemon=True)
        self._thread.start()
        return self.place

    def _relay(self, channel, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                message = channel.recv()
            except (EOFError, OSError) as e:  # the actor's end closed: its process or node is gone
                if not stop.is_set():
                    self._error = self._death(e)
                return
            self._outbox.put(message)

    def _death(self, e: BaseException) -> str:
        """Ray's word on the actor once its channel closed (it says why the actor died)."""
        try:
            ray.get(self.actor.where.remote(), timeout=30)
        except Exception as d:  # noqa: BLE001 - the actor died: Ray's reason is the message
            return f"{type(d).__name__}: {str(d).strip()[:2000]}"
        return f"its channel closed ({type(e).__name__}: {e}) while the actor still answers"

    def send(self, message) -> None:
        try:
            self._channel.send(message)
        except OSError:  # the actor is gone: check() says so once the relay saw it
            pass

    def check(self) -> None:
        if self._error is not None:
            raise RoleError(f"engine {self.engine_id} (Ray actor on {self.place}) died: {self._error}")

    def restart(self) -> None:
        """A new actor for a dead one, placed like it; the weight broadcast group re-forms with it
        (``regroup`` first, so it joins the new generation). Returns once its channel is open."""
        self._stop.set()
        if self._channel is not None:  # None: it died before its channel opened
            self._channel.close()
        with contextlib.suppress(Exception):  # dead already: what is left of it goes
            ray.kill(self.actor)
        self.restarts += 1
        self._regroup()
        self.actor, self._error = self._make(), None
        try:
            self._placed(self.locate(self._timeout))
        except Exception as e:  # noqa: BLE001 - the replacement did not start: stop the run naming it
            raise RoleError(f"engine {self.engine_id}: its replacement Ray actor did not start within "
                            f"{self._timeout:g}s: {type(e).__name__}: {str(e).strip()[:2000]}") from None

    def join(self, timeout: float) -> None:
        with contextlib.suppress(Exception):  # it is being stopped either way
            ray.get(self.actor.join.remote(timeout), timeout=timeout + 5)
        self._stop.set()
        ray.kill(self.actor)
        if self._channel is not None:
            self._channel.close()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(5)


@ray.remote(max_concurrency=2)
class TrainerRankActor:
    """``TrainerRankActor(spec, writers)`` is one trainer rank: a ``LocalTrainer``
    or, with several ranks, an ``FSDPTrainer`` in a torch.distributed group
    (gloo on CPU, NCCL on GPU) rendezvousing at ``spec.rendezvous`` (a ``trainer.serve.RankSpec``), served by
    a ``TrainerHost``. ``call(method, (args, kwargs))`` answers an ``Answer``
    (the traceback when the method raised).
    """
    def __init__(self, spec: RankSpec, writers: list):
        import torch

        from conveyor.trainer.serve import TrainerHost, build_rank
        torch.set_num_threads(max(1, spec.threads))
        trainer = build_rank(spec)
        self._host = TrainerHost(trainer, writers, spec.publish_dtype, rank=spec.rank)

    def where(self) -> Place:
        return where()

    def stacks(self) -> str:
        """Every thread's stack (beside a call in progress: the actor runs two at once)."""
        from conveyor.runtime.watchdog import own_stacks
        return own_stacks()

    def call(self, method: str, arguments: tuple[tuple, dict]) -> Answer:
        args, kwargs = arguments
        try:
            return Answer(True, getattr(self._host, method)(*args, **kwargs))
        except Exception:  # noqa: BLE001 - sent back to the controller with the traceback
            return Answer(False, traceback.format_exc())

    def close(self) -> None:
        self._host.close()


class RayTrainerProxy(TrainerProxy):
    """``TrainerProxy``'s calls over trainer rank actors.

    ``RayTrainerProxy`` is ``launch.roles.TrainerProxy`` over those actors:
    every call goes to every rank, rank 0's answer is returned, and the first
    rank that raises or dies ends the call with a ``RoleError`` naming the
    rank, its node and pid and carrying the real traceback.
    """

    def __init__(self, actors: list, places: list[Place], timeout: float, collective_s: float = 0.0):
        super().__init__([], timeout, collective_s)
        self._actors, self._places = actors, places

    def _name(self, r: int) -> str:
        return "trainer" if len(self._actors) == 1 else f"trainer{r}"

    def _call(self, method: str, *args, **kwargs) -> list:
        t0 = time.monotonic()
        timeout = self._deadline(method)
        # The arguments (a step's batch) go into the object store once, not once per rank.
        shared = ray.put((args, kwargs))
        refs = [a.call.remote(method, shared) for a in self._actors]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        answers: dict[int, object] = {}
        pending, deadline = list(refs), t0 + timeout
        while pending:
            # In slices: a call stops as soon as another role of the run has failed (``stop_if``).
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=max(0.0, min(_SLICE_S, deadline - time.monotonic())))
            if not done and time.monotonic() < deadline:
                stop_for(self._failed(), ", ".join(f"{self._name(rank_of[p])}.{method}" for p in pending))
                continue
            if not done:
                what = f"{', '.join(self._name(rank_of[p]) for p in pending)}.{method} did not answer within " \
                       f"{timeout:g}s"
                raise RoleError(f"{what} (launch.timeout_s); where each role was:\n{watchdog.dump_stacks(what)}")
            r = rank_of[done[0]]
            try:
                answer = ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - the actor or its node died
                raise RoleError(f"{self._name(r)}.{method}: the Ray actor on {self._places[r]} "
                                f"died: {type(e).__name__}: {str(e).strip()[:2000]}") from None
            if not answer.ok:
                raise RoleError(f"{self._name(r)}.{method} raised on {self._places[r]}:\n"
                                f"{answer.value}")
            answers[r] = answer.value
        self._deadlines.observe(method, time.monotonic() - t0)
        return [answers[r] for r in range(len(self._actors))]

    def close(self) -> None:
        for a in self._actors:
            with contextlib.suppress(Exception):  # closing a dead rank: nothing left to close
                ray.get(a.close.remote(), timeout=30)
            ray.kill(a)
