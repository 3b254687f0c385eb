"""Reward workers as Ray actors: ``reward.executor=ray`` (with ``launch.backend=ray``).

A piece of the Ray launcher: the reward role's process service (``reward/processes.py``) with
its workers placed on the cluster; the run (``run/session.py``) starts it where
``reward.executor=ray``, through ``ray_reward_service``.
- ``RayRewardService`` is a ``processes.ProcessRewardService`` whose workers are Ray actors:
  the same handle, results, counters, deadlines and restart rule; only the worker changes.
- ``RewardPlacement``: the workers' own placement group, one bundle per worker; one the
  cluster cannot hold is a ``PluginError`` before the run.
- ``RewardActor`` scores on its main thread; ``RayRewardWorker`` is it behind a
  ``worker.WorkerProcess``'s face.

It knows nothing of what a reward computes.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conveyor.launch.ray_roles import UNKNOWN, Place, where
from conveyor.plugins import PluginError
from conveyor.reward.processes import ProcessRewardService
from conveyor.reward.worker import answer, load, unpicklable
from conveyor.transport.messages import RewardLoaded, ScoreReply, ScoreRequest

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config import LaunchConfig, RewardConfig
    from conveyor.reward.factory import RewardSpec


@ray.remote(max_restarts=0, max_concurrency=1)
class RewardActor:
    """``RewardActor(spec, fallback)`` loads the reward (``load()``: a
    ``RewardLoaded``) and scores ``ScoreRequest``s (``score(request)``: a
    ``ScoreReply``) on its main thread (a Ray actor of concurrency 1), with the
    process worker's own functions (``worker.load`` / ``worker.answer``).
    """
    def __init__(self, spec: RewardSpec, fallback: float):
        import sys
        if "torch" in sys.modules:  # one intra-op thread per worker, as the process workers
            sys.modules["torch"].set_num_threads(1)
        self._spec, self._fallback = spec, fallback
        self._fn = None
        self._name = ""

    def where(self) -> Place:
        return where()

    def load(self) -> RewardLoaded:
        self._fn, loaded = load(self._spec)
        self._name = loaded.name
        return loaded

    def score(self, req: ScoreRequest) -> ScoreReply:
        from conveyor.reward.api import BatchReward
        reply = answer(self._fn, isinstance(self._fn, BatchReward), self._name, req, self._fallback)
        try:
            pickle.dumps(reply)
        except Exception as e:  # noqa: BLE001 - the reward's info did not pickle
            return unpicklable(reply, self._name, self._fallback, e)
        return reply


@dataclass(frozen=True)
class RewardPlacement:
    """Where the reward actors go.

    ``RewardPlacement(resources, strategy, timeout_s)``: the workers' own
    placement group, one bundle per worker (``{"CPU": 1, **resources}``, e.g.
    ``{node_b: 0.1}`` to put them on a node, ``{GPU: 1}`` for a reward model on
    a GPU of its own), placed with ``strategy`` (``SPREAD``: over the nodes).
    A replacement goes back into its predecessor's bundle. A group the cluster
    cannot hold within ``timeout_s`` is a ``PluginError`` before the run. The
    group is removed by ``close()``.
    """
    resources: dict[str, float] = field(default_factory=dict)
    strategy: str = "PACK"
    timeout_s: float = 120.0

    def bundle(self) -> dict[str, float]:
        return {"CPU": 1.0, **self.resources}


class RayRewardWorker:
    """A ``RewardActor`` with a ``WorkerProcess``'s face.

    ``RayRewardWorker`` is that actor behind a ``worker.WorkerProcess``'s face
    (``conn``, ``sentinel``, ``ask_to_exit``, ``join``, ``end``): a driver
    thread relays requests from a local pipe to the actor and its replies
    back; when the actor dies (a kill at a deadline, its process or node gone)
    the pipe closes, which the supervisor sees as a worker's death, and
    ``end()`` says how it ended in words (Ray's error, with the actor's node
    and pid), where a process worker's gives its exit code.
    """

    def __init__(self, actor, track: str) -> None:
        self.actor, self.track = actor, track
        self.conn, self._inner = multiprocessing.Pipe(duplex=True)
        self._dead_r, self._dead_w = os.pipe()  # readable (EOF) once the relay ends
        self.sentinel = self._dead_r
        self.place = UNKNOWN
        self._ending = ""
        self._thread = threading.Thread(target=self._relay, name=f"{track}-ray-relay", daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        try:
            self.place = ray.get(self.actor.where.remote())
            self._inner.send(ray.get(self.actor.load.remote()))
            while True:
                req = self._inner.recv()
                if req is None:
                    break
                self._inner.send(ray.get(self.actor.score.remote(req)))
        except (EOFError, OSError):  # the supervisor closed its end: ending by request
            pass
        except Exception as e:  # noqa: BLE001 - the actor died (or was killed): the supervisor sees EOF
            self._ending = f"(a Ray actor) died on {self.place}: {type(e).__name__}: " + \
                (str(e).strip().splitlines() or [""])[0][:300].rstrip(".")
        finally:
            self._inner.close()
            os.close(self._dead_w)

    def ask_to_exit(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(max(0.0, timeout_s))

    def end(self) -> str:
        """Kill the actor (if it still runs), stop the relay; how the worker ended, in words."""
        ended = self._ending
        with contextlib.suppress(Exception):  # dead already
            ray.kill(self.actor, no_restart=True)
        self.conn.close()
        self._thread.join(10.0)
        if not self._thread.is_alive():
            os.close(self._dead_r)
        return ended or f"(a Ray actor) was stopped on {self.place}"


class RayRewardService(ProcessRewardService):
    """``ProcessRewardService`` over Ray actors.

    ``RayRewardService(spec, placement, **process_service_kwargs)`` is a
    ``processes.ProcessRewardService`` whose workers are Ray actors instead of
    local processes: the same ``api.RewardHandle``, the same results, counters,
    deadlines and restart rule (a call past ``timeout_s``: the actor is killed
    and replaced, its trajectories get the fallback, counted ``timeouts``; a
    dead actor is replaced and its trajectories are scored once more; more than
    ``max_restarts`` deaths in a row stop the run naming the reward), because
    only the worker changes: the pool's supervisor is the process service's.
    ``places()``: where each worker runs now (``launch.ray_roles.Place``).
    """

    def __init__(self, spec: RewardSpec, placement: RewardPlacement, workers: int = 2, **kwargs) -> None:
        bundles = [placement.bundle() for _ in range(workers)]
        self._pg = placement_group(bundles, strategy=placement.strategy, name=f"conveyor-reward-{uuid.uuid4().hex[:8]}")
        try:
            ray.get(self._pg.ready(), timeout=placement.timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            raise PluginError(f"reward {spec.name!r}: Ray could not place the reward workers' bundles {bundles} "
                              f"(launch.ray_reward_strategy={placement.strategy}) within {placement.timeout_s:g}s; "
                              f"the cluster has {ray.cluster_resources()}: lower reward.workers or change "
                              "launch.ray_reward_resources") from None
        self._gpus = placement.bundle().get("GPU", 0.0)
        self._live: dict[int, RayRewardWorker] = {}
        try:
            super().__init__(spec, workers=workers, **kwargs)
        except BaseException:
            if self._pg is not None:  # (close() removed it when the pool had stopped)
                remove_placement_group(self._pg)
                self._pg = None
            raise

    def _worker(self, index: int, track: str) -> RayRewardWorker:
        actor = RewardActor.options(
            num_cpus=1, num_gpus=self._gpus, name=f"conveyor-reward{index}-{uuid.uuid4().hex[:6]}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=index),
        ).remote(self.spec, self.fallback)
        self._live[index] = RayRewardWorker(actor, track)
        return self._live[index]

    def places(self) -> dict[int, Place]:
        """Where each worker's current actor runs (``UNKNOWN`` until it said so)."""
        return {i: w.place for i, w in sorted(self._live.items())}

    def close(self, timeout_s: float | None = None) -> None:
        super().close(timeout_s)
        if self._pg is not None and not self._thread.is_alive():
            remove_placement_group(self._pg)
            self._pg = None


def ray_reward_service(cfg: RewardConfig, spec: RewardSpec, launch: LaunchConfig | None = None) -> RayRewardService:
    """``reward.executor=ray``: the reward workers as Ray actors.

    ``ray_reward_service(cfg, spec, launch)``: the service of ``reward.executor=ray`` for the
    run's ``reward`` section ``cfg`` and ``launch`` section (None: the defaults): a
    ``RayRewardService`` placed by ``launch.ray_reward_resources`` / ``ray_reward_strategy``
    within ``launch.timeout_s``, with the section's deadline, fallback, workers, restarts and
    batch wait (``reward.factory.reward_service`` starts the other executors).
    """
    from conveyor.config import LaunchConfig as _Launch
    la = launch or _Launch()
    return RayRewardService(spec, RewardPlacement(dict(la.ray_reward_resources), la.ray_reward_strategy,
                                                  la.timeout_s),
                            timeout_s=cfg.timeout_s, fallback=cfg.fallback, workers=cfg.workers,
                            max_restarts=cfg.max_restarts, batch_wait_s=cfg.batch_wait_ms / 1e3)
