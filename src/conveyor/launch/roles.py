"""Start the trainer ranks and the engine workers where ``launch.placement`` says.

Contract
- ``start_engines(cfg, path, tokenizer, routes, placement, run_dir)`` returns the
  engine handles, the shared outbox and the context limit. In-process: one
  engine in a thread of this process. Otherwise ``launch.engines`` child
  processes, engine i on ``placement.engine_devices[i]`` with
  ``launch.engine_threads`` CPU threads, polling ``routes.readers[i]``.
- ``start_trainer(cfg, path, tokenizer, routes, placement, run_dir)`` returns an
  object with the ``TrainerHost`` methods (train, logprobs, ref_logprobs,
  values, publish, step, save_checkpoint, load_checkpoint, export_hf): the
  host itself (in-process) or a proxy that calls every trainer rank process
  (``launch.trainer_ranks`` of them; more than one form a torch.distributed
  group and train with FSDP2) and returns rank 0's answer. A rank that raises
  or dies stops the call at once with its name; the others are stopped.
- ``make_routes`` / ``plan`` (placement.py) decide devices and transports.
Every start waits for the children to report ready, with the launch
deadline, and a child that dies while starting is reported with its log.

It knows nothing of the loop's schedule or of the formulas.
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from conveyor.config import RunConfig
from conveyor.launch.placement import Placement, free_port
from conveyor.launch.procs import RoleError, RoleProcess, RpcClient, call_all
from conveyor.launch.workers import TrainerHost, engine_loop, engine_process, trainer_process
from conveyor.producer import EngineHandle


def mp_context():
    import torch.multiprocessing as tmp
    return tmp.get_context("spawn")


def make_trainer(cfg: RunConfig, path: str, tokenizer):
    from conveyor.trainer.local import LocalTrainer
    return LocalTrainer(path, cfg.trainer, **trainer_kwargs(cfg, tokenizer))


def trainer_kwargs(cfg: RunConfig, tokenizer) -> dict:
    # The trainer recomputes logprobs of the distribution the engine sampled from.
    return {"total_steps": cfg.trainer.total_steps or cfg.loop.steps,
            "temperature": cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
            "pad_token_id": tokenizer.pad_token_id or 0}


class TrainerProxy:
    """The trainer ranks in their own processes, called like the in-process TrainerHost:
    every call goes to every rank (they run it together) and rank 0's answer is returned."""

    def __init__(self, rpcs: list[RpcClient], timeout: float):
        self._rpcs, self._timeout = rpcs, timeout

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: call_all(self._rpcs, name, a, k, self._timeout)[0]

    def close(self) -> None:
        for rpc in self._rpcs:
            rpc.stop()


def start_trainer(cfg: RunConfig, path: str, tokenizer, routes, placement: Placement, run_dir: Path):
    if placement.sync == "inprocess":
        return TrainerHost(make_trainer(cfg, path, tokenizer), routes.writers[0])
    ctx = mp_context()
    n = cfg.launch.trainer_ranks
    port = free_port()
    dtypes = {t.dtype for ws in routes.writers.values() for t in ws}
    publish_dtype = dtypes.pop() if len(dtypes) == 1 else None
    rpcs: list[RpcClient] = []
    try:
        for r in range(n):
            parent, child = ctx.Pipe()
            dev = placement.trainer_devices[r]
            tcfg = cfg.trainer.model_copy(update={"device": dev}) if dev != "cpu" else cfg.trainer
            spec = {"path": path, "trainer": tcfg.model_dump(mode="json"), **trainer_kwargs(cfg, tokenizer),
                    "rank": r, "world": n, "port": port, "device": dev,
                    "collective_timeout_s": cfg.launch.collective_timeout_s, "publish_dtype": publish_dtype}
            proc = RoleProcess("trainer" if n == 1 else f"trainer{r}", trainer_process,
                               (spec, child, routes.writers.get(r, [])), run_dir / "logs", ctx,
                               threads=cfg.launch.trainer_threads)
            rpcs.append(RpcClient(parent, proc))
        for rpc in rpcs:
            _await(lambda: rpc.conn.poll(0.1), rpc.proc, cfg.launch.timeout_s, rpc.proc.role, rpcs)
            rpc.conn.recv()
    except BaseException:
        for rpc in rpcs:
            rpc.proc.stop(timeout=1)
        raise
    return TrainerProxy(rpcs, cfg.launch.timeout_s)


def start_engines(cfg: RunConfig, path: str, tokenizer, routes, placement: Placement, run_dir: Path):
    partial = cfg.loop.partial_rollouts
    if placement.sync == "inprocess":
        from conveyor.rollout.factory import make_engine
        engine = make_engine(cfg.rollout, path, tokenizer)
        inbox, outbox = queue.Queue(), queue.Queue()
        t = threading.Thread(target=engine_loop, args=(engine, inbox, outbox, routes.readers[0], 0, partial,
                                                       cfg.launch.timeout_s),
                             name="engine0", daemon=True)
        t.start()
        return [EngineHandle(0, inbox, thread=t)], outbox, engine.context_limit
    ctx = mp_context()
    outbox = ctx.Queue()
    handles = []
    for i, device in enumerate(placement.engine_devices):
        rollout = cfg.rollout.model_copy(update={"device": device}) if device != "cpu" else cfg.rollout
        spec = {"path": path, "rollout": rollout.model_dump(mode="json"), "device": device,
                "timeout_s": cfg.launch.timeout_s}
        inbox = ctx.Queue()
        proc = RoleProcess(f"engine{i}", engine_process, (spec, inbox, outbox, routes.readers[i], i, partial),
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


def _await(ready, proc: RoleProcess, timeout: float, what: str, peers=()) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        proc.check()
        for rpc in peers:  # a rank that dies while starting leaves the others waiting for it
            rpc.proc.check()
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
