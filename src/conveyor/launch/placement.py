"""Which device each trainer rank and engine gets, and how weights reach each engine.

- ``plan(cfg, visible_gpus=None) -> Placement``: each role's device and the weight sync kind; a
  placement that does not fit the visible GPUs raises ``PlacementError`` naming the counts and
  the fix. Nothing assumes a particular count.
- ``make_routes(cfg, placement, path, ctx) -> Routes``: the transports, allocated once by the
  controller and handed to the processes.
- ``reward_device(cfg, visible_gpus=None)``: where a reward model runs.

It knows nothing of training, generation or the loop.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.config import RunConfig
from conveyor.transport.api import WeightReader, WeightWriter

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.transport.broadcast import BroadcastWeights


class PlacementError(ValueError):
    """The requested placement does not fit this machine; the message says what to change."""


@dataclass
class Placement:
    trainer_devices: list[str]
    engine_devices: list[str]
    sync: str  # inprocess | shm | ipc | broadcast

    @property
    def gpu(self) -> bool:
        return any(d.startswith("cuda") for d in self.trainer_devices + self.engine_devices)

    @property
    def trainer_alone(self) -> bool:
        """Whether every trainer rank is on a GPU that no engine uses."""
        t = self.trainer_devices
        return bool(t) and all(d.startswith("cuda") for d in t) and not set(t) & set(self.engine_devices)


@dataclass
class Routes:
    controller: "WeightWriter | Fanout | None"  # where warm-start weights go (None: no warm start)
    writers: dict[int, list[WeightWriter]] = field(default_factory=dict)
    readers: dict[int, WeightReader] = field(default_factory=dict)
    # The weight broadcast group the engines are members of (None: another route). A restarted
    # engine re-forms it (``BroadcastWeights.regroup``).
    group: "BroadcastWeights | None" = None


def _wants_gpu(cfg: RunConfig) -> bool:
    import torch
    return torch.cuda.is_available() and cfg.trainer.device != "cpu" and cfg.rollout.device != "cpu"


def plan(cfg: RunConfig, visible_gpus: int | None = None) -> Placement:
    """``plan(cfg, visible_gpus=None) -> Placement``: ``trainer_devices[r]`` and
    ``engine_devices[i]`` ("cuda:k" or "cpu") and the weight sync kind:
    * colocated, one rank and one engine: both in the controller ("inprocess").
    * colocated, N ranks: engine i beside rank i on GPU i ("ipc"), or on CPU ("shm").
    * disaggregated on GPUs: ranks on GPUs 0..N-1, engines on GPUs N..N+M-1,
      weights by NCCL "broadcast"; with a single visible GPU every role shares
      it and weights go by "ipc". On CPU: "shm", or "broadcast" (gloo) if asked.
    A placement that does not fit the visible GPUs raises ``PlacementError``
    naming the counts and the fix. Nothing assumes a particular count.
    """
    la = cfg.launch
    n, m = la.trainer_ranks, la.engines
    if visible_gpus is None:
        import torch
        visible_gpus = torch.cuda.device_count() if _wants_gpu(cfg) else 0
    if la.in_process:
        dev = "cuda:0" if visible_gpus else "cpu"
        return Placement([dev], [dev], "inprocess")
    if visible_gpus == 0:
        sync = "broadcast" if la.weight_sync == "broadcast" else "shm"
        if la.weight_sync == "ipc":
            raise PlacementError("launch.weight_sync=ipc needs GPUs; on CPU use shm or broadcast")
        return Placement(["cpu"] * n, ["cpu"] * m, sync)
    if la.placement == "colocated":
        if n > visible_gpus:
            raise PlacementError(f"launch.trainer_ranks={n} with placement=colocated needs {n} GPUs but "
                                 f"{visible_gpus} are visible; lower launch.trainer_ranks and launch.engines")
        devs = [f"cuda:{k}" for k in range(n)]
        return _checked(Placement(devs, list(devs), "ipc"), la.weight_sync)
    if n + m <= visible_gpus:
        p = Placement([f"cuda:{k}" for k in range(n)], [f"cuda:{n + k}" for k in range(m)], "broadcast")
        return _checked(p, la.weight_sync)
    if visible_gpus == 1 and n == 1:
        # Roles share the one GPU (time-sliced by the driver); weights stay on it.
        return _checked(Placement(["cuda:0"], ["cuda:0"] * m, "ipc"), la.weight_sync)
    raise PlacementError(
        f"launch.placement=disaggregated needs launch.trainer_ranks + launch.engines = {n} + {m} = {n + m} "
        f"GPUs but {visible_gpus} are visible; lower them, or use launch.placement=colocated")


def reward_device(cfg: RunConfig, visible_gpus: int | None = None) -> str:
    """``reward_device(cfg, visible_gpus=None)``: where a reward model (``reward.fn:
    rm``) runs: ``reward.device`` as given, or for ``auto`` / ``trainer`` the
    device of trainer rank 0 (so on one GPU it shares the device, and its
    memory, with the trainer and the colocated engine).
    """
    d = cfg.reward.device
    if d in ("auto", "trainer"):
        return plan(cfg, visible_gpus).trainer_devices[0]
    return "cuda:0" if d == "cuda" else d


def _checked(p: Placement, wanted: str) -> Placement:
    if wanted in ("auto", p.sync):
        return p
    if wanted == "shm":  # always possible: a CPU staging copy in shared memory
        return Placement(p.trainer_devices, p.engine_devices, "shm")
    raise PlacementError(f"launch.weight_sync={wanted} does not fit this placement (trainer on "
                         f"{p.trainer_devices}, engines on {p.engine_devices}); use auto or {p.sync}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_dtype(cfg: RunConfig, path: str, device: str):
    """The dtype engines hold weights in, so staging and broadcast carry no wider type."""
    import torch
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if cfg.rollout.dtype == "native":
        from conveyor.runtime.devices import native_dtype
        return names[native_dtype(device)[0]]
    if cfg.rollout.dtype != "auto":
        return names[cfg.rollout.dtype]
    if not device.startswith("cuda"):
        return torch.float32
    from transformers import AutoConfig
    dt = getattr(AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code), "dtype", None)
    dt = names.get(dt, dt) if isinstance(dt, str) else dt
    return dt if dt in (torch.bfloat16, torch.float16) else torch.float32


def make_routes(cfg: RunConfig, p: Placement, path: str, ctx) -> Routes:
    """``make_routes(cfg, placement, path, ctx) -> Routes``: the transports,
    allocated once by the controller and handed to the processes:
    ``writers[r]`` are what trainer rank r publishes to (rank 0 feeds shm and
    broadcast; rank r feeds the IPC staging on its GPU), ``readers[i]`` is what
    engine i polls, ``controller`` is where the controller publishes the
    warm-start weights (every engine reads it), ``group`` the broadcast group
    (re-formed when an engine is restarted) or None.
    """
    from conveyor.transport.weights import Fanin, StagedWeights, weight_specs
    # vLLM keeps its own lm_head copy after a reload: send it every name.
    specs = weight_specs(path, cfg.model.trust_remote_code, dedupe_tied=cfg.rollout.engine == "native")
    lo = cfg.trainer.lora
    if lo.enabled and lo.publish == "adapter":  # only the adapters travel
        from conveyor.transport.adapter import adapter_specs
        specs = adapter_specs(path, lo.target_modules, lo.rank, cfg.model.trust_remote_code)
    if p.sync == "inprocess":
        w = StagedWeights(specs, None, device=p.trainer_devices[0])
        return Routes(w, {0: [w]}, {0: w})
    dtype = engine_dtype(cfg, path, p.engine_devices[0])
    typed = [(n, s, dtype) for n, s, _ in specs]
    if p.sync == "shm":
        w = StagedWeights(specs, ctx)
        return Routes(w, {0: [w]}, {i: w for i in range(len(p.engine_devices))})
    if p.sync == "ipc":
        import torch
        stagings = {dev: StagedWeights(typed, ctx, device=dev) for dev in sorted(set(p.engine_devices))}
        writers: dict[int, list] = {}
        for dev, w in stagings.items():
            rank = p.trainer_devices.index(dev) if dev in p.trainer_devices else 0
            writers.setdefault(rank, []).append(w)
        torch.cuda.synchronize()
        readers = {i: stagings[d] for i, d in enumerate(p.engine_devices)}
        controller = stagings[p.engine_devices[0]] if len(stagings) == 1 else Fanout(list(stagings.values()))
        return Routes(controller, writers, readers)
    from conveyor.transport.broadcast import BroadcastWeights
    bw = BroadcastWeights(typed, ctx, engines=len(p.engine_devices), backend="nccl" if p.gpu else "gloo",
                          dtype=dtype, port=free_port(), bucket_mb=cfg.launch.weight_bucket_mb,
                          timeout_s=cfg.launch.collective_timeout_s)
    # Warm-start weights come from the controller, which is not in the broadcast group.
    warm = StagedWeights(specs, ctx) if cfg.sft.steps > 0 else None
    readers = {i: Fanin([warm, bw]) if warm is not None else bw for i in range(len(p.engine_devices))}
    return Routes(warm, {0: [bw]}, readers, bw)


class Fanout:
    """The controller's warm-start publish into several stagings (one per engine GPU)."""

    def __init__(self, transports: list):
        self.transports = transports

    def publish(self, named_tensors, version: int) -> None:
        from conveyor.transport.weights import publish_all
        publish_all(self.transports, named_tensors, version)
