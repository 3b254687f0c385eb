"""Start the trainer and the engine workers where ``launch.placement`` says.

Contract
- ``start_engines(cfg, path, tokenizer, weights, run_dir)`` returns the engine
  handles and the shared outbox. Colocated: one engine in a thread of this
  process. Disaggregated: ``launch.engines`` child processes, each with
  ``launch.engine_threads`` CPU threads, reading weights from shared memory.
- ``start_trainer(cfg, path, tokenizer, weights, run_dir)`` returns an object
  with the ``TrainerHost`` methods (train, logprobs, ref_logprobs, values,
  publish, step, save_checkpoint, load_checkpoint, export_hf, named_weights):
  the host itself (colocated) or a proxy that calls it in a child process
  with ``launch.trainer_threads`` threads (disaggregated).
- ``make_weights(cfg, named)``: the weight transport matching the placement.
Every start waits for the child to report ready, with the launch deadline,
and a child that dies while starting is reported with its log.

It knows nothing of the loop's schedule or of the formulas.
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from conveyor.config import RunConfig
from conveyor.launch.procs import RoleError, RoleProcess, RpcClient
from conveyor.launch.workers import TrainerHost, engine_loop, engine_process, trainer_process
from conveyor.producer import EngineHandle
from conveyor.transport.weights import StagedWeights, weight_specs


def mp_context():
    import torch.multiprocessing as tmp
    return tmp.get_context("spawn")


def disaggregated(cfg: RunConfig) -> bool:
    return cfg.launch.placement == "disaggregated"


def make_weights(cfg: RunConfig, path: str) -> StagedWeights:
    from conveyor.trainer.local import resolve_device
    specs = weight_specs(path, cfg.model.trust_remote_code)
    if disaggregated(cfg):
        return StagedWeights(specs, mp_context())
    return StagedWeights(specs, None, device=resolve_device(cfg.trainer.device))


def make_trainer(cfg: RunConfig, path: str, tokenizer):
    from conveyor.trainer.local import LocalTrainer
    return LocalTrainer(path, cfg.trainer, **trainer_kwargs(cfg, tokenizer))


def trainer_kwargs(cfg: RunConfig, tokenizer) -> dict:
    # The trainer recomputes logprobs of the distribution the engine sampled from.
    return {"total_steps": cfg.trainer.total_steps or cfg.loop.steps,
            "temperature": cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
            "pad_token_id": tokenizer.pad_token_id or 0}


class TrainerProxy:
    """The trainer in its own process, called like the in-process TrainerHost."""

    def __init__(self, rpc: RpcClient, timeout: float):
        self._rpc, self._timeout = rpc, timeout

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self._rpc.call(name, *a, timeout=self._timeout, **k)

    def close(self) -> None:
        self._rpc.stop()


def start_trainer(cfg: RunConfig, path: str, tokenizer, weights: StagedWeights, run_dir: Path):
    if not disaggregated(cfg):
        return TrainerHost(make_trainer(cfg, path, tokenizer), weights)
    ctx = mp_context()
    parent, child = ctx.Pipe()
    spec = {"path": path, "trainer": cfg.trainer.model_dump(mode="json"), **trainer_kwargs(cfg, tokenizer)}
    proc = RoleProcess("trainer", trainer_process, (spec, child, weights), run_dir / "logs", ctx,
                       threads=cfg.launch.trainer_threads)
    _await(lambda: parent.poll(0.1), proc, cfg.launch.timeout_s, "trainer")
    parent.recv()
    return TrainerProxy(RpcClient(parent, proc), cfg.launch.timeout_s)


def start_engines(cfg: RunConfig, path: str, tokenizer, weights: StagedWeights, run_dir: Path):
    partial = cfg.loop.partial_rollouts
    if not disaggregated(cfg):
        from conveyor.rollout.factory import make_engine
        engine = make_engine(cfg.rollout, path, tokenizer)
        inbox, outbox = queue.Queue(), queue.Queue()
        t = threading.Thread(target=engine_loop, args=(engine, inbox, outbox, weights, 0, partial),
                             name="engine0", daemon=True)
        t.start()
        return [EngineHandle(0, inbox, thread=t)], outbox, engine.context_limit
    ctx = mp_context()
    outbox = ctx.Queue()
    spec = {"path": path, "rollout": cfg.rollout.model_dump(mode="json")}
    handles = []
    for i in range(cfg.launch.engines):
        inbox = ctx.Queue()
        proc = RoleProcess(f"engine{i}", engine_process, (spec, inbox, outbox, weights, i, partial),
                           run_dir / "logs", ctx, threads=cfg.launch.engine_threads)
        handles.append(EngineHandle(i, inbox, process=proc))
    context_limit, ready = None, set()
    deadline = time.monotonic() + cfg.launch.timeout_s
    while len(ready) < len(handles):
        for h in handles:
            h.check()
        try:
            msg = outbox.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise RoleError(f"engines did not start within {cfg.launch.timeout_s:.0f}s "
                                f"({len(ready)}/{len(handles)} ready)") from None
            continue
        if msg[0] == "error":
            raise RoleError(f"engine {msg[1]} failed while starting:\n{msg[2]}")
        if msg[0] == "ready":
            ready.add(msg[1])
            context_limit = msg[2]
    return handles, outbox, context_limit


def _await(ready, proc: RoleProcess, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        proc.check()
        if time.monotonic() > deadline:
            raise RoleError(f"{what} did not start within {timeout:.0f}s; last lines of its log:\n"
                            f"{proc.last_lines()}")


def stop_engines(handles: list[EngineHandle]) -> None:
    for h in handles:
        try:
            h.inbox.put(("stop",))
        except (OSError, ValueError):
            pass
    for h in handles:
        if h.process is not None:
            h.process.stop(timeout=10)
        elif h.thread is not None:
            h.thread.join(timeout=10)
