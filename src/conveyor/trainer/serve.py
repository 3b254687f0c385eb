"""The trainer's host: one trainer (one rank of it) behind the ``TrainerHandle`` calls.

- ``TrainerHost(trainer, writers, publish_dtype, rank)`` is the ``TrainerHandle``
  (``trainer/api.py``) of a trainer in this process, and what a trainer rank process serves to
  the controller (``serve_rpc``); its weights leave from this process as a step ends, without
  waiting for the engines' receives.
- ``RankSpec``: what a trainer rank is built from, frozen; ``build_rank(spec)`` builds it;
  ``trainer_process(spec, conn, writers)`` is a trainer rank's child process main.

It knows nothing of the loop's schedule, the admission rule or engines.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.config import TrainerConfig
from conveyor.trainer.api import LossFn, Trainer
from conveyor.transport.api import WeightWriter
from conveyor.transport.messages import Span, Trained
from conveyor.transport.weights import publish_all

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class RankSpec:
    """One trainer rank, as its process (or Ray actor) builds it.

    ``RankSpec`` is what a trainer rank is built from, frozen: the model's path, its
    ``TrainerConfig`` (device set), the run's totals, its place among the ranks and where
    they meet; ``launch.roles.rank_spec`` makes it for every launcher. ``build_rank(spec)``
    builds the rank's trainer; ``trainer_process(spec, conn, writers)`` is the main of a
    trainer rank's child process: bind the device, join the ranks' process group (world > 1,
    FSDP2), build the trainer, serve until stopped, close its writers.
    """

    path: str                       # the model's directory
    trainer: TrainerConfig          # the trainer section, with this rank's device
    total_steps: int                # train() calls the LR schedule spans
    temperature: float              # the engine's sampling temperature: logprobs of that distribution
    pad_token_id: int
    rank: int
    world: int                      # trainer ranks; more than one form a process group
    device: str                     # "cpu" or "cuda:i", bound before anything is built
    rendezvous: str                 # "host:port" where the ranks' process group meets (rank 0's)
    collective_timeout_s: float
    publish_dtype: "torch.dtype | None"  # the engines' dtype when all agree (None: float32)
    threads: int                    # torch threads of the rank's process


class TrainerHost:
    """A ``TrainerHandle`` over a trainer object of this process.

    ``TrainerHost(trainer, writers, publish_dtype, rank)`` is the ``TrainerHandle``
    (``trainer/api.py``) of a trainer in this process, and what a trainer rank
    process serves to the controller (``serve_rpc``). ``publish(version)`` is
    one pass over the trainer's weights (collective for a sharded trainer:
    every rank runs it) feeding the weight writers this rank owns (possibly
    none), in the engines' dtype. ``train_and_publish(batch, loss_fn,
    version)`` is a train call whose weights leave as its optimizer step ends,
    from this process, not after a round trip through the controller; a
    trainer that ``streams_publish`` runs its last optimizer step group by
    group inside the publish. Neither waits for the engines' receives: each
    engine waits for the version its chunks were admitted for. ``accumulate(part,
    loss_fn, micro_batch_tokens)`` and ``finish_and_publish(version)`` are the
    same step taken part by part as a step's groups arrive (one rank). ``describe()``
    is one line for the run's log: the ranks, and with several, which kind of
    trainer they are (``trainer.parallel``). Its answer's
    ``spans`` are this rank's train and publish spans (wall time), after those
    of the forward-only calls (``logprobs``, ``ref_logprobs``, ``values``)
    since the previous train call, for the run's timeline.
    """

    def __init__(self, trainer: Trainer, writers: list[WeightWriter], publish_dtype=None, rank: int = 0):
        # publish_dtype: the same on every rank (the gathers are collective), None = float32.
        self.trainer, self.writers, self.publish_dtype = trainer, list(writers), publish_dtype
        self.track = f"rank {rank}"  # this rank's row in the run's timeline
        self._spans: list[Span] = []  # forward-only calls since the last train call, sent with its answer

    def train_and_publish(self, batch, loss_fn: LossFn, version: int) -> Trained:
        return self._step_and_publish(version, lambda **kw: self.trainer.train(batch, loss_fn, **kw))

    def accumulate(self, part, loss_fn: LossFn, micro_batch_tokens: int | None = None,
                   sms: int | None = None) -> None:
        """Forward and backward of one part of the step's batch (``trainer/accumulation.py``)."""
        start = time.time()
        try:
            self.trainer.accumulate(part, loss_fn, micro_batch_tokens, sms)
        finally:
            self._spans.append(Span(self.track, "accumulate", start, time.time(), {"samples": len(part)}))

    def fits(self, tokens: int, length: int) -> bool:
        return self.trainer.fits(tokens, length)

    def set_micro_batch_tokens(self, tokens: int) -> None:
        self.trainer.cfg.micro_batch_tokens = tokens

    def stop_if(self, failed) -> None:
        """Nothing to do: this trainer's calls run in the caller's thread and wait on no other role."""

    def describe(self) -> str:
        t = self.trainer
        kind = getattr(t, "parallel", None)
        if kind is None:
            return f"one rank on {t.device}{_native(t)}"
        how = {"replicate": "the whole model on every rank", "fsdp": "FSDP2, the model sharded over them"}[kind]
        auto = ", chosen by trainer.parallel=auto" if t.cfg.parallel == "auto" else ""
        return f"{t.world} ranks on {t.device.type}, {how} ({kind}{auto}){_native(t)}"

    def finish_and_publish(self, version: int) -> Trained:
        """The optimizer step over the accumulated parts; its weights leave as ``version``."""
        return self._step_and_publish(version, self.trainer.train_accumulated)

    def _step_and_publish(self, version: int, step) -> Trained:
        """``step(**publish_kwargs)`` runs the optimizer work; the new weights leave as ``version``."""
        before, self._spans = tuple(self._spans), []
        start = time.time()
        if not self.trainer.streams_publish:
            metrics = step()
            trained = time.time()
            publish_s = self.publish(version)
            spans = (*before, Span(self.track, "train", start, trained, {"version": version}),
                     Span(self.track, "publish", trained, trained + publish_s, {"version": version}))
            return Trained(metrics, self.trainer.step_ended or trained, publish_s, spans)
        spent, parts = [], []

        def publish(named) -> None:
            t0, wall0 = time.perf_counter(), time.time()
            try:
                publish_all(self.writers, named, version, wait=False)
            finally:
                spent.append(time.perf_counter() - t0)
                parts.append(Span(self.track, "publish", wall0, wall0 + spent[-1], {"version": version}))
        metrics = step(publish=publish, publish_dtype=self.publish_dtype)
        # The publish parts ran inside the train call (its last optimizer step, group by group).
        spans = (*before, Span(self.track, "train", start, time.time(), {"version": version}), *parts)
        return Trained(metrics, self.trainer.step_ended, sum(spent), spans)

    def publish(self, version: int) -> float:
        t0 = time.perf_counter()
        # A sharded trainer gathers half the bytes for bf16 engines; a single-device one hands
        # its bf16 compute copy (the masters rounded as a cast would).
        named = self.trainer.named_weights(self.publish_dtype) if self.publish_dtype else self.trainer.named_weights()
        publish_all(self.writers, named, version, wait=False)
        return time.perf_counter() - t0

    def logprobs(self, batch):
        return self._timed("logprobs", self.trainer.logprobs, batch)

    def ref_logprobs(self, batch):
        return self._timed("ref_logprobs", self.trainer.ref_logprobs, batch)

    def values(self, batch):
        return self._timed("values", self.trainer.values, batch)

    def _timed(self, name: str, fn, batch):
        start = time.time()
        try:
            return fn(batch)
        finally:
            self._spans.append(Span(self.track, name, start, time.time()))

    def step(self) -> int:
        return self.trainer.step

    def save_checkpoint(self, path, extra) -> None:
        self.trainer.save(path, extra, wait=False)  # written while training goes on, where the trainer can

    def load_checkpoint(self, path) -> dict:
        return self.trainer.load(path)

    def export_hf(self, path) -> None:
        self.trainer.export_hf(path)

    def close(self) -> None:
        self.trainer.wait_saved()  # a checkpoint being written is finished before the trainer goes
        for w in self.writers:  # a broadcast whose transfer is still running ends first
            with contextlib.suppress(Exception):  # the engines are stopping too
                w.close()


def _native(trainer) -> str:
    """What ``trainer.param_dtype=native`` chose, in words (nothing for another setting)."""
    if trainer.cfg.param_dtype != "native":
        return ""
    from conveyor.runtime.devices import native_dtype
    dtype, why = native_dtype(trainer.device)
    dtype = "bfloat16" if trainer.device.type == "cuda" else dtype  # a GPU: auto's choice
    return f"; trainer.param_dtype=native: {dtype} ({why})"


def choose_parallel(cfg, path: str, device: str) -> str:
    """What ``trainer.parallel`` means on this rank: fsdp or replicate as asked; auto is replicate on
    a GPU whose free memory (engines on the same GPU start first and have taken theirs) holds the
    whole model's training state twice over (the rest is for activations), fsdp otherwise and on
    CPU ranks (where replicate was not measured faster)."""
    if cfg.parallel != "auto":
        return cfg.parallel
    if not device.startswith("cuda"):
        return "fsdp"
    import torch

    from conveyor.trainer.models import training_state_bytes
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return "replicate" if 2 * training_state_bytes(path, cfg) <= free else "fsdp"


def _agreed_parallel(mine: str, device: str) -> str:
    """Every rank builds the same kind: replicate only if it fits on every rank."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if mine == "replicate" else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return "replicate" if int(flag.item()) else "fsdp"


def build_rank(spec: RankSpec):
    """One trainer rank from its spec: bind the device; one rank is a ``LocalTrainer``, several join
    a process group at ``spec.rendezvous`` (nccl on GPUs, gloo on CPU) and are ``FSDPTrainer`` or
    ``ReplicatedTrainer`` ranks (``trainer.parallel``; auto chooses with ``choose_parallel``, the
    same on every rank)."""
    from datetime import timedelta

    from conveyor.runtime.procs import bind_device
    bind_device(spec.device)
    cfg = spec.trainer.model_copy(deep=True)  # this rank's own: set_micro_batch_tokens changes it
    kwargs = {"total_steps": spec.total_steps, "temperature": spec.temperature, "pad_token_id": spec.pad_token_id}
    if spec.world == 1:
        from conveyor.trainer.single import LocalTrainer
        return LocalTrainer(spec.path, cfg, **kwargs)
    import torch.distributed as dist

    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{spec.rendezvous}", rank=spec.rank, world_size=spec.world,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    parallel = choose_parallel(cfg, spec.path, spec.device)
    if cfg.parallel == "auto":
        parallel = _agreed_parallel(parallel, spec.device)
    if parallel == "replicate":
        from conveyor.trainer.replicated import ReplicatedTrainer
        return ReplicatedTrainer(spec.path, cfg, **kwargs)
    from conveyor.trainer.fsdp import FSDPTrainer
    return FSDPTrainer(spec.path, cfg, **kwargs)


def trainer_process(spec: RankSpec, conn, writers: list[WeightWriter]) -> None:
    """Main of a trainer rank's process: bind the device, join the ranks, build, serve."""
    from conveyor.runtime.procs import serve_rpc
    from conveyor.transport.messages import Answer
    trainer = build_rank(spec)
    conn.send(Answer(True, "ready"))
    host = TrainerHost(trainer, writers, spec.publish_dtype, rank=spec.rank)
    serve_rpc(host, conn)
    host.close()
