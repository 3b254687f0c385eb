"""Start the trainer ranks and the engine workers where ``launch.placement`` says.

Contract
- ``start_engines(cfg, path, tokenizer, routes, placement, run_dir)`` returns
  the ``EngineWorker`` handles (``rollout/api.py``), the outbox they all
  answer on and the engines' context limit. In-process: one engine worker in
  a thread of this process (``ThreadWorker``). Otherwise ``launch.engines``
  child processes (``ProcessWorker``), engine i on
  ``placement.engine_devices[i]`` with ``launch.engine_threads`` CPU threads,
  reading ``routes.readers[i]``. Both run ``rollout.serve.engine_loop``.
  A child that dies is restarted by the producer (``ProcessWorker.restart``);
  on a weight broadcast group (``routes.group``) the group re-forms with it.
- ``start_trainer(cfg, path, tokenizer, routes, placement, run_dir)`` returns
  a ``TrainerHandle`` (``trainer/api.py``): the ``TrainerHost`` itself
  (in-process) or a ``TrainerProxy`` that calls every trainer rank process
  (``launch.trainer_ranks``; more than one form a torch.distributed group and
  train with FSDP2) and returns rank 0's answer. A rank that raises or dies
  stops the call at once with its name. ``rank_spec(cfg, path, tokenizer, rank,
  device, rendezvous, publish_dtype)`` is the ``trainer.serve.RankSpec`` a rank is
  built from, here and under Ray (``launch/ray.py``).
Every start waits for the children to report ready, with the launch
deadline, and a child that dies while starting is reported with its log.

It knows nothing of the loop's schedule or of the formulas.
"""
from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from conveyor.config import RunConfig
from conveyor.launch.placement import Placement, free_port
from conveyor.rollout.api import EngineWorker
from conveyor.rollout.serve import engine_loop, engine_process
from conveyor.runtime.procs import RoleError, RoleProcess, RpcClient, call_all, stop_for
from conveyor.runtime.watchdog import Deadlines
from conveyor.trainer.api import LossFn
from conveyor.trainer.serve import RankSpec, TrainerHost, trainer_process
from conveyor.transport.messages import Failed, Ready, Stop, Trained


def mp_context():
    import torch.multiprocessing as tmp
    return tmp.get_context("spawn")


def make_trainer(cfg: RunConfig, path: str, tokenizer):
    from conveyor.trainer.single import LocalTrainer
    return LocalTrainer(path, cfg.trainer, **trainer_kwargs(cfg, tokenizer))


def trainer_kwargs(cfg: RunConfig, tokenizer) -> dict:
    # The trainer recomputes logprobs of the distribution the engine sampled from.
    return {"total_steps": cfg.trainer.total_steps or cfg.loop.steps,
            "temperature": cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
            "pad_token_id": tokenizer.pad_token_id or 0}


def rank_spec(cfg: RunConfig, path: str, tokenizer, rank: int, device: str, rendezvous: str,
              publish_dtype) -> RankSpec:
    """Trainer rank ``rank``'s spec, for every launcher: the trainer section with ``device`` (a GPU's;
    on CPU the section's own), the run's totals, and where the ranks meet (``rendezvous``, host:port)."""
    tcfg = cfg.trainer.model_copy(update={"device": device}) if device != "cpu" else cfg.trainer
    la = cfg.launch
    return RankSpec(path=path, trainer=tcfg, **trainer_kwargs(cfg, tokenizer), rank=rank, world=la.trainer_ranks,
                    device=device, rendezvous=rendezvous, collective_timeout_s=la.collective_timeout_s,
                    publish_dtype=publish_dtype, threads=la.trainer_threads)


class TrainerProxy:
    """The ``TrainerHandle`` of trainer ranks in their own processes: every call goes to every
    rank (they run it together) and rank 0's answer is returned."""

    # Calls that publish weights: on a broadcast group a publish may first wait for a dead
    # engine's replacement to join (up to launch.collective_timeout_s, then a named error) and
    # send it the version again; the call's deadline covers both, so that error, not the call's
    # own deadline, is what stops the run.
    PUBLISHES = ("train_and_publish", "finish_and_publish", "publish")

    def __init__(self, rpcs: list[RpcClient], timeout: float, collective_s: float = 0.0):
        self._rpcs = rpcs
        self._deadlines = Deadlines(timeout)  # a call's deadline grows with the longest call seen
        self._collective_s = float(collective_s)
        self._failed: Callable[[], BaseException | None] = lambda: None

    def _deadline(self, method: str) -> float:
        return self._deadlines.of(method) + (2 * self._collective_s if method in self.PUBLISHES else 0.0)

    def stop_if(self, failed: Callable[[], BaseException | None]) -> None:
        self._failed = failed

    def _call(self, method: str, *args, **kwargs) -> list:
        t0 = time.monotonic()
        answers = call_all(self._rpcs, method, args, kwargs, self._deadline(method), self._failed)
        self._deadlines.observe(method, time.monotonic() - t0)
        return answers

    def _all(self, method: str, *args, **kwargs):
        return self._call(method, *args, **kwargs)[0]

    def train_and_publish(self, batch, loss_fn: LossFn, version: int) -> Trained:
        answers = self._call("train_and_publish", batch, loss_fn, version)
        # Rank 0's answer, with every rank's spans: each rank is a row of the timeline.
        return dataclasses.replace(answers[0], spans=tuple(s for a in answers for s in a.spans))

    def accumulate(self, part, loss_fn: LossFn, micro_batch_tokens: int | None = None,
                   sms: int | None = None) -> None:
        self._all("accumulate", part, loss_fn, micro_batch_tokens, sms)

    def fits(self, tokens: int, length: int) -> bool:
        return all(self._call("fits", tokens, length))  # every rank's memory must hold it

    def set_micro_batch_tokens(self, tokens: int) -> None:
        self._call("set_micro_batch_tokens", tokens)

    def describe(self) -> str:
        return self._all("describe")

    def finish_and_publish(self, version: int) -> Trained:
        answers = self._call("finish_and_publish", version)
        return dataclasses.replace(answers[0], spans=tuple(s for a in answers for s in a.spans))

    def publish(self, version: int) -> float:
        return self._all("publish", version)

    def logprobs(self, batch):
        return self._all("logprobs", batch)

    def ref_logprobs(self, batch):
        return self._all("ref_logprobs", batch)

    def values(self, batch):
        return self._all("values", batch)

    def step(self) -> int:
        return self._all("step")

    def save_checkpoint(self, path, extra) -> None:
        self._all("save_checkpoint", path, extra)

    def load_checkpoint(self, path) -> dict:
        return self._all("load_checkpoint", path)

    def export_hf(self, path) -> None:
        self._all("export_hf", path)

    def close(self) -> None:
        for rpc in self._rpcs:
            rpc.stop()


class ThreadWorker:
    """An ``EngineWorker``: ``engine_loop`` in a thread of this process."""

    restartable = False  # an engine in this process that fails has raised: it is not a death

    def __init__(self, engine_id: int, inbox: queue.Queue, thread: threading.Thread,
                 abort: Callable[[], None] | None = None):
        self.engine_id, self._inbox, self._thread = engine_id, inbox, thread
        self._abort = abort  # ends the engine's call in progress (``RolloutEngine.abort``), if it has one

    def restart(self) -> None:
        raise RoleError(f"engine {self.engine_id} runs in the controller's process and cannot be restarted")

    def send(self, message) -> None:
        self._inbox.put(message)

    def check(self) -> None:
        if not self._thread.is_alive():
            raise RoleError(f"engine {self.engine_id} thread ended unexpectedly")

    def join(self, timeout: float) -> None:
        """Wait for the thread (after a ``Stop``), ending each generate call it is in at its next
        decode step: a thread still inside torch when the interpreter exits aborts the process."""
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            if self._abort is not None:
                self._abort()
            self._thread.join(timeout=min(0.1, max(0.0, deadline - time.monotonic())))


class ProcessWorker:
    """An ``EngineWorker``: ``engine_process`` in a child process, answering on a queue of its
    own that a relay thread moves into the shared ``outbox`` (a child killed while writing can
    then leave nothing torn or locked in the channel the other engines share).
    ``restart()`` replaces a dead child with a new one on the same device and weight route:
    it builds the engine again and takes the newest published weights when the first request
    asks for them; the caller requeues what the dead one had in flight. On a weight broadcast
    group ``regroup`` (``BroadcastWeights.regroup``) is called first: the group re-forms with
    the new child and the writer sends it the current version."""

    restartable = True

    def __init__(self, engine_id: int, start: Callable[[object, object], RoleProcess], ctx, outbox: queue.Queue,
                 regroup: Callable[[], int] | None = None):
        self.engine_id, self._start, self._ctx, self._outbox = engine_id, start, ctx, outbox
        self._regroup = regroup
        self.restarts = 0
        self._launch()

    def _launch(self) -> None:
        self._inbox, own = self._ctx.Queue(), self._ctx.Queue()
        self._process = self._start(self._inbox, own)
        stop = threading.Event()
        self._relay_stop = stop
        threading.Thread(target=_relay, args=(own, self._outbox, stop), name=f"engine{self.engine_id}-relay",
                         daemon=True).start()

    def send(self, message) -> None:
        self._inbox.put(message)

    def check(self) -> None:
        self._process.check()

    def restart(self) -> None:
        self._relay_stop.set()  # the dead child's channel is abandoned, whatever it holds
        self._process.stop(timeout=0)
        for q in (self._inbox,):
            q.cancel_join_thread()
            q.close()
        self.restarts += 1
        if self._regroup is not None:
            self._regroup()  # before the new child joins: it joins the next generation
        self._launch()

    def join(self, timeout: float) -> None:
        self._process.stop(timeout=timeout)
        self._relay_stop.set()


def _relay(source, outbox: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            msg = source.get(timeout=0.2)
        except queue.Empty:
            continue
        except (EOFError, OSError, ValueError):
            return
        if not stop.is_set():
            outbox.put(msg)


def start_trainer(cfg: RunConfig, path: str, tokenizer, routes, placement: Placement, run_dir: Path,
                  failed=lambda: None):
    if placement.sync == "inprocess":
        if placement.gpu:
            # This process's torch threads only do the host side of the GPU's work (collation, packed
            # layouts, small ops), where waking a pool of threads costs more than it saves.
            import torch
            torch.set_num_threads(cfg.launch.trainer_threads)
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
            spec = rank_spec(cfg, path, tokenizer, r, placement.trainer_devices[r], f"127.0.0.1:{port}",
                             publish_dtype)
            proc = RoleProcess("trainer" if n == 1 else f"trainer{r}", trainer_process,
                               (spec, child, routes.writers.get(r, [])), run_dir / "logs", ctx,
                               threads=cfg.launch.trainer_threads)
            rpcs.append(RpcClient(parent, proc))
        for rpc in rpcs:
            _await(lambda: rpc.conn.poll(0.1), rpc.proc, cfg.launch.timeout_s, rpc.proc.role, rpcs, failed)
            rpc.conn.recv()
    except BaseException:
        for rpc in rpcs:
            rpc.proc.stop(timeout=1)
        raise
    return TrainerProxy(rpcs, cfg.launch.timeout_s, cfg.launch.collective_timeout_s)


def start_engines(cfg: RunConfig, path: str, tokenizer, routes, placement: Placement,
                  run_dir: Path) -> tuple[list[EngineWorker], object, int, str]:
    partial = cfg.loop.partial_rollouts
    if placement.sync == "inprocess":
        from conveyor.rollout.factory import make_engine
        engine = make_engine(cfg.rollout, path, tokenizer)
        if engine.cuda_device is not None:
            # The engine's decode loop must get the interpreter back from the trainer's thread within
            # a fraction of a millisecond (a step accumulated beside it), as in an engine process.
            sys.setswitchinterval(0.0005)
        inbox, outbox = queue.Queue(), queue.Queue()
        t = threading.Thread(target=engine_loop, args=(engine, inbox, outbox, routes.readers[0], 0, partial,
                                                       cfg.launch.timeout_s),
                             name="engine0", daemon=True)
        t.start()
        return [ThreadWorker(0, inbox, t, getattr(engine, "abort", None))], outbox, engine.context_limit, engine.label
    ctx = mp_context()
    outbox: queue.Queue = queue.Queue()
    workers = []
    for i, device in enumerate(placement.engine_devices):
        rollout = cfg.rollout.model_copy(update={"device": device}) if device != "cpu" else cfg.rollout
        spec = {"path": path, "rollout": rollout.model_dump(mode="json"), "device": device,
                "timeout_s": cfg.launch.timeout_s}

        def start(inbox, own, i=i, spec=spec) -> RoleProcess:
            return RoleProcess(f"engine{i}", engine_process, (spec, inbox, own, routes.readers[i], i, partial),
                               run_dir / "logs", ctx, threads=cfg.launch.engine_threads)
        regroup = routes.group.regroup if routes.group is not None else None
        workers.append(ProcessWorker(i, start, ctx, outbox, regroup))
    context_limit, label = await_ready(workers, outbox, cfg.launch.timeout_s)
    return workers, outbox, context_limit, f"{label} x {len(workers)}" if len(workers) > 1 else label


def await_ready(workers: list[EngineWorker], outbox: queue.Queue, timeout_s: float) -> tuple[int, str]:
    """Wait for every engine's ``Ready`` on ``outbox`` (a worker that dies or fails while starting
    is named); returns the engines' context limit and label."""
    context_limit, label, ready = 0, "", set()
    deadline = time.monotonic() + timeout_s
    while len(ready) < len(workers):
        for w in workers:
            w.check()
        try:
            msg = outbox.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise RoleError(f"engines did not start within {timeout_s:g}s ({len(ready)}/{len(workers)} "
                                "ready)") from None
            continue
        if isinstance(msg, Failed):
            raise RoleError(f"engine {msg.engine_id} failed while starting:\n{msg.traceback}")
        if isinstance(msg, Ready):
            ready.add(msg.engine_id)
            context_limit, label = msg.context_limit, msg.label
    return context_limit, label


def _await(ready, proc: RoleProcess, timeout: float, what: str, peers=(), failed=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        proc.check()
        for rpc in peers:  # a rank that dies while starting leaves the others waiting for it
            rpc.proc.check()
        stop_for(failed(), what, "was starting")  # an engine that died meanwhile: the start is not waited for
        if time.monotonic() > deadline:
            raise RoleError(f"{what} did not start within {timeout:g}s; last lines of its log:\n"
                            f"{proc.last_lines()}")


def stop_engines(workers: list[EngineWorker]) -> None:
    for w in workers:
        try:
            w.send(Stop())
        except (OSError, ValueError):
            pass
    for w in workers:
        w.join(timeout=10)
