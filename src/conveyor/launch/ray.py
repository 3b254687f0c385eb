"""The Ray launcher: trainer ranks and engines as Ray actors in one placement group.

- ``launchers(cfg)`` (``run.ray.run_ray`` runs a run in it) connects to the cluster at
  ``launch.ray_address`` (empty: a local Ray for the run) and yields the factory of
  ``RayLauncher``s; at the end it closes every launcher made and disconnects. The controller
  never leaves the driver process.
- ``RayLauncher`` provides the ``launch.api.Launcher`` calls: one placement group with a bundle
  per role; weights by ``BroadcastWeights`` from trainer rank 0; a dead engine replaced in its
  bundle; where every role ran written to ``run_dir/ray_placement.json``.
- A group the cluster cannot place within ``launch.timeout_s`` is a ``SetupError``; colocated
  placement on GPUs is not supported (``SetupError`` before anything starts).

It knows nothing of the loop, the schedule or the formulas.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import queue
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import (
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conveyor.config import RunConfig
from conveyor.launch.api import Engines
from conveyor.launch.placement import Routes, engine_dtype, free_port
from conveyor.launch.ray_roles import (
    EngineActor,
    Place,
    RayTrainerProxy,
    RayWorker,
    TrainerRankActor,
    WarmWeights,
    get_unless_failed,
)
from conveyor.launch.roles import await_ready, make_warm_trainer, rank_spec, stop_engines
from conveyor.rollout.restarts import EngineRestarts
from conveyor.runtime import watchdog
from conveyor.runtime.errors import RoleError, SetupError
from conveyor.trainer.api import TrainerHandle

__all__ = ["RayLauncher", "launchers"]


@dataclass(frozen=True)
class Placed:
    """A role's actor: where it runs, its bundle, and its node's custom resources."""
    place: Place
    bundle: int
    resources: dict[str, float]


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int, int]:
    """Rank 0's node address and two ports free there (weight broadcast, trainer ranks)."""
    return ray.util.get_node_ip_address(), free_port(), free_port()


class RayLauncher:
    """The ``launch.api.Launcher`` calls on a Ray cluster:
    - one placement group (``launch.ray_strategy``) with a bundle per trainer
      rank and per engine (disaggregated) or per (rank i, engine i) pair
      (colocated); a bundle asks for the role's CPU threads, one GPU when the
      roles run on GPUs, and the extra resources ``launch.ray_trainer_resources``
      / ``ray_engine_resources`` name (custom node resources pin roles to nodes).
      A group the cluster cannot place within ``launch.timeout_s`` is a
      ``SetupError`` naming the bundles and the cluster's resources.
    - weights always by ``BroadcastWeights`` from trainer rank 0 (gloo on CPU,
      NCCL on GPU; shm staging cannot cross nodes), its rendezvous on rank 0's
      node and its counters in a TCPStore served by the driver
      (``transport.store_state``). The same deadline/version transaction as in
      the local launch.
    - engines: ``ray_roles.EngineActor`` / ``RayWorker``; a dead one (while
      the engines start too) is replaced by a new actor in its bundle
      (``launch.max_restarts``; no standby actors) and the
      weight broadcast group re-forms with it (``BroadcastWeights.regroup``);
      trainer: ``ray_roles.TrainerRankActor`` / ``RayTrainerProxy`` (several
      ranks train with FSDP2 over gloo or NCCL across actors).
    - where every role ran (``ray_roles.Place``: node address, Ray node id,
      host, pid; with its bundle and the node's custom resources) is written to
      ``run_dir/ray_placement.json`` as the roles start (``places``).
    - warm-start weights (``sft.steps > 0``; the controller is outside the
      broadcast group) go to the engine actors through the object store
      (``ray_roles.WarmWeights``). The trainer ranks read ``run_dir/warmstart``:
      the nodes must share the run directory's filesystem.
    Not supported (``SetupError`` before anything starts): colocated placement on
    GPUs (it needs a same-GPU IPC route).
    """
    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        la = cfg.launch
        self.gpu = cfg.trainer.device != "cpu" and cfg.rollout.device != "cpu" and \
            ray.cluster_resources().get("GPU", 0) > 0
        if self.gpu and la.placement == "colocated":
            raise SetupError("launch.backend=ray with GPUs needs launch.placement=disaggregated (a colocated "
                             "engine would share its trainer rank's GPU in one broadcast group)")
        self.pg = None
        self.places: dict[str, Placed] = {}
        self.routes: Routes | None = None
        self._store = None
        self._bundle_of: dict[str, int] = {}
        self._watched: list[str] = []  # roles registered with the watchdog

    # ------------------------------------------------------------ placement
    def _bundles(self) -> list[dict]:
        la, gpu = self.cfg.launch, (1 if self.gpu else 0)
        trainer = {"CPU": la.trainer_threads, **({"GPU": gpu} if gpu else {}), **la.ray_trainer_resources}
        engine = {"CPU": la.engine_threads, **({"GPU": gpu} if gpu else {}), **la.ray_engine_resources}
        n, m = la.trainer_ranks, la.engines
        if la.placement == "colocated":
            both = {k: trainer.get(k, 0) + engine.get(k, 0) for k in trainer.keys() | engine.keys()}
            self._bundle_of = {**{f"trainer{r}": r for r in range(n)}, **{f"engine{i}": i for i in range(m)}}
            return [dict(both) for _ in range(max(n, m))]
        self._bundle_of = {**{f"trainer{r}": r for r in range(n)}, **{f"engine{i}": n + i for i in range(m)}}
        return [dict(trainer) for _ in range(n)] + [dict(engine) for _ in range(m)]

    def _strategy(self, role: str) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self._bundle_of[role])

    def _place(self) -> None:
        bundles = self._bundles()
        have = ray.cluster_resources()
        short = {k: (need, have.get(k, 0.0)) for k in {k for b in bundles for k in b}
                 if (need := sum(b.get(k, 0) for b in bundles)) > have.get(k, 0.0)}
        if short:  # no placement can fit: say so now rather than after the placement deadline
            lack = ", ".join(f"{k} {need:g} (the cluster has {got:g})" for k, (need, got) in sorted(short.items()))
            raise SetupError(f"the roles' bundles {bundles} need {lack}; add nodes, or lower launch.*_threads, "
                             "launch.engines or launch.trainer_ranks")
        self.pg = placement_group(bundles, strategy=self.cfg.launch.ray_strategy, name=f"conveyor-{uuid.uuid4().hex[:8]}")
        try:
            ray.get(self.pg.ready(), timeout=self.cfg.launch.timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            self.pg = None
            raise SetupError(f"Ray could not place the roles' bundles {bundles} (strategy "
                             f"{self.cfg.launch.ray_strategy}) within {self.cfg.launch.timeout_s:g}s; the "
                             f"cluster has {ray.cluster_resources()}: add nodes or lower launch.*_threads, "
                             "launch.engines or launch.trainer_ranks") from None

    def _record(self, role: str, place: Place) -> None:
        # ray.nodes() rows are Ray's own dicts; what this run keeps of them is named below.
        resources = {n["NodeID"]: n["Resources"] for n in ray.nodes()}.get(place.node_id, {})
        standard = ("CPU", "GPU", "memory", "object_store_memory")
        custom = {k: v for k, v in resources.items() if k not in standard and not k.startswith("node:")}
        self.places[role] = Placed(place, self._bundle_of[role], custom)
        rows = {r: {**dataclasses.asdict(p.place), "bundle": p.bundle, "resources": p.resources}
                for r, p in self.places.items()}
        path = self.run_dir / "ray_placement.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=1, sort_keys=True))

    # ------------------------------------------------------------- weights
    def _routes(self, path: str) -> Routes:
        from conveyor.transport.broadcast import BroadcastWeights
        from conveyor.transport.store_state import StoreState, serve_store
        from conveyor.transport.weights import weight_specs
        la = self.cfg.launch
        ip, bport, self._master_port = ray.get(_rendezvous.options(scheduling_strategy=self._strategy("trainer0"))
                                               .remote(), timeout=la.timeout_s)
        self._master = ip
        driver = ray.util.get_node_ip_address()
        self._store = serve_store(driver, la.collective_timeout_s)
        state = StoreState(driver, self._store.port, f"conveyor-weights-{uuid.uuid4().hex[:8]}",
                           la.collective_timeout_s)
        specs = weight_specs(path, self.cfg.model.trust_remote_code, dedupe_tied=self.cfg.rollout.engine == "native")
        lo = self.cfg.trainer.lora
        if lo.enabled and lo.publish == "adapter":  # only the adapters travel
            from conveyor.transport.adapter import adapter_specs
            specs = adapter_specs(path, lo.target_modules, lo.rank, self.cfg.model.trust_remote_code)
        dtype = engine_dtype(self.cfg, path, "cuda:0" if self.gpu else "cpu")
        bw = BroadcastWeights([(n, s, dtype) for n, s, _ in specs], state, engines=la.engines,
                              backend="nccl" if self.gpu else "gloo", dtype=dtype, port=bport,
                              bucket_mb=la.weight_bucket_mb, timeout_s=la.collective_timeout_s, host=ip)
        return Routes(None, {0: [bw]}, {i: bw for i in range(la.engines)}, bw)

    # ------------------------------------------------------------ launcher
    def start_engines(self, path: str, tokenizer) -> Engines:
        cfg, la = self.cfg, self.cfg.launch
        self._place()
        self.routes = self._routes(path)
        device = "cuda:0" if self.gpu else "cpu"  # an actor sees only the GPU Ray gave it
        rollout = cfg.rollout.model_copy(update={"device": device}) if self.gpu else cfg.rollout
        spec = {"path": path, "rollout": rollout.model_dump(mode="json"), "device": device,
                "timeout_s": la.timeout_s, "threads": la.engine_threads}
        outbox: queue.Queue = queue.Queue()
        workers = []
        for i in range(la.engines):
            def make(i=i, incarnation=itertools.count()):  # noqa: B008 - one counter per engine
                # A replacement goes to the dead one's bundle, under a name of its own.
                return EngineActor.options(num_cpus=la.engine_threads, num_gpus=1 if self.gpu else 0,
                                           scheduling_strategy=self._strategy(f"engine{i}"),
                                           name=f"conveyor-engine{i}-{self.pg.id.hex()[:8]}-{next(incarnation)}") \
                    .remote(spec, self.routes.readers[i], i, cfg.loop.partial_rollouts)

            def placed(place: Place, i=i) -> None:
                self._record(f"engine{i}", place)
            workers.append(RayWorker(i, make, outbox, self.routes.group.regroup, placed, la.timeout_s))
            self._watch(f"engine{i}", lambda w=workers[-1]: w.actor)
        restarts = EngineRestarts(la.max_restarts)
        try:
            for w in workers:
                self._locate(w, restarts)
            context_limit, label = await_ready(workers, outbox, la.timeout_s, restarts)
        except BaseException:
            stop_engines(workers)
            raise
        warm = WarmWeights(lambda: [w.actor for w in workers], self.routes.writers[0][0].names, la.timeout_s)
        return Engines(workers, outbox, context_limit, f"{label} x {len(workers)}" if len(workers) > 1 else label,
                       warm, restarts)

    def _locate(self, worker: RayWorker, restarts: EngineRestarts) -> None:
        """Where a new engine actor runs; one that died before it could say is restarted (the
        replacement records its own place) within the run's budget."""
        try:
            place = worker.locate(self.cfg.launch.timeout_s)
        except ray.exceptions.RayActorError as e:
            dead = RoleError(f"engine {worker.engine_id} (Ray actor) died while starting: {type(e).__name__}: "
                             f"{str(e).strip()[:2000]}")
            restarts.replace(worker, dead, " while the engines start")
            return
        self._record(f"engine{worker.engine_id}", place)

    def start_trainer(self, path: str, tokenizer, failed=lambda: None) -> TrainerHandle:
        cfg, la = self.cfg, self.cfg.launch
        device = "cuda:0" if self.gpu else "cpu"
        bw = self.routes.writers[0][0]
        actors = []
        for r in range(la.trainer_ranks):
            spec = rank_spec(cfg, path, tokenizer, r, device, f"{self._master}:{self._master_port}", bw.dtype)
            actors.append(TrainerRankActor.options(num_cpus=la.trainer_threads, num_gpus=1 if self.gpu else 0,
                                                   scheduling_strategy=self._strategy(f"trainer{r}"))
                          .remote(spec, self.routes.writers.get(r, [])))
        places = []
        for r, a in enumerate(actors):
            try:
                places.append(get_unless_failed(a.where.remote(), la.timeout_s, failed, f"trainer rank {r}"))
            except Exception as e:  # noqa: BLE001 - the rank's constructor raised, its node or an engine died
                for b in actors:
                    ray.kill(b)
                if isinstance(e, RoleError):
                    raise
                raise RoleError(f"trainer rank {r} did not start: {type(e).__name__}: {str(e).strip()[:3000]}") \
                    from None
            self._record(f"trainer{r}", places[-1])
            self._watch(f"trainer{r}", lambda a=a: a)
        return RayTrainerProxy(actors, places, la.timeout_s, la.collective_timeout_s)

    def warm_start_trainer(self, cfg: RunConfig, path: str, tokenizer):
        # On CPU the engine actors may share this machine's cores (a local Ray instance).
        return make_warm_trainer(cfg, path, tokenizer, beside_engines=not self.gpu)

    def stop_engines(self, workers) -> None:
        stop_engines(workers)

    def trainer_gpus_alone(self) -> bool:
        return self.gpu  # with GPUs every role's bundle has one of its own (colocated is refused)

    def _watch(self, role: str, actor) -> None:
        """A wait that runs out asks the role's actor (``actor()``: the current one) for its stacks."""
        watchdog.register_remote(role, lambda timeout: ray.get(actor().stacks.remote(), timeout=timeout))
        self._watched.append(role)

    def close(self) -> None:
        """Remove the placement group (what is still running in it ends) and the weight counters."""
        for role in self._watched:
            watchdog.unregister_remote(role)
        self._watched = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        self._store = None


def connect(cfg: RunConfig) -> bool:
    """Connect this process to ``launch.ray_address`` or start a local Ray; True if this call connected."""
    if ray.is_initialized():
        return False
    if cfg.launch.ray_address:
        address = cfg.launch.ray_address
        _probe(address)
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise SetupError(f"launch.ray_address={address}: could not connect to the Ray cluster ({first}); "
                             "check the address (`ray status` on the head node prints it)") from None
    else:  # a Ray of this run only: as many CPUs as the roles' bundles ask for (threads, not cores)
        ray.init(num_cpus=max(os.cpu_count() or 1, cpus_needed(cfg)), include_dashboard=False,
                 log_to_driver=False, object_store_memory=200 * 2**20)
    return True


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """A ``host:port`` that nothing answers on is a one-line error in seconds: Ray itself would
    retry it for many minutes. (``auto`` and ``ray://`` addresses are Ray's to resolve.)"""
    import socket
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise SetupError(f"launch.ray_address={address}: give host:port (the head node's GCS address, e.g. "
                         "10.0.0.1:6379), auto, or empty for a Ray of the run's own")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise SetupError(f"launch.ray_address={address}: nothing answers there ({e.strerror or e}); start the "
                         "cluster (ray start --head) or fix the address") from None


def cpus_needed(cfg: RunConfig) -> int:
    la = cfg.launch
    rewards = cfg.reward.workers if cfg.reward.executor == "ray" else 0  # one CPU each
    if la.placement == "colocated":
        return max(la.trainer_ranks, la.engines) * (la.trainer_threads + la.engine_threads) + rewards
    return la.trainer_ranks * la.trainer_threads + la.engines * la.engine_threads + rewards


@contextlib.contextmanager
def launchers(cfg: RunConfig) -> Iterator[Callable[[RunConfig, Path], RayLauncher]]:
    """Connected to the cluster, the factory of the run's ``RayLauncher``s.

    Contract: ``launchers(cfg)`` (``run.ray.run_ray`` runs a run in it) connects
    to the cluster at ``launch.ray_address`` (empty: ``ray.init()`` starts a local
    Ray instance for the run, stopped after it) and yields the factory of
    ``RayLauncher``s the run builds in this process (the driver: the controller
    never leaves it); at the end it closes every launcher made (their placement
    groups removed) and disconnects. ``RayLauncher`` provides the
    ``launch.api.Launcher`` calls:
    """
    connected = connect(cfg)
    made: list[RayLauncher] = []

    def launcher(c: RunConfig, d: Path) -> RayLauncher:
        made.append(RayLauncher(c, d))
        return made[-1]
    try:
        yield launcher
    finally:
        for la in made:
            la.close()
        if connected:
            ray.shutdown()
