"""Start the trainer ranks and the engine workers where ``launch.placement`` says.

- ``start_engines(...)``: the ``EngineWorker`` handles (``rollout/api.py``), in a thread of this
  process (``ThreadWorker``) or in child processes (``ProcessWorker``); a child that dies is
  restarted within the run's budget, optionally from a standby process.
- ``start_trainer(...)``: a ``TrainerHandle`` (``trainer/api.py``), the ``TrainerHost`` itself or
  a ``TrainerProxy`` over trainer rank processes; ``rank_spec`` builds a rank's spec, here and
  under Ray.
- Every start waits for the children to report ready, with the launch deadline; a trainer rank
  that dies or raises stops the call at once with its name.

It knows nothing of the loop's schedule or of the formulas.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from conveyor.config import RunConfig
from conveyor.launch.placement import Placement, free_port
from conveyor.rollout.api import EngineWorker
from conveyor.rollout.restarts import EngineRestarts
from conveyor.rollout.serve import engine_loop, engine_process, engine_standby
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


def make_warm_trainer(cfg: RunConfig, path: str, tokenizer, beside_engines: bool):
    """The supervised warm start's trainer in this process. ``beside_engines`` (CPU engines in
    processes of their own): this process's torch takes the cores they leave (``warm_start_threads``)."""
    if beside_engines:
        import torch
        torch.set_num_threads(warm_start_threads(cfg))
    return make_trainer(cfg, path, tokenizer)


def warm_start_threads(cfg: RunConfig) -> int:
    """The cores ``launch.engines`` x ``launch.engine_threads`` leave (at least 1, at most torch's
    default). With as many OpenMP threads as cores, every parallel op waited at its barrier for
    a thread that another process (an engine's weight watcher, anything else on the machine)
    had taken the core from: on 2 loaded cores the warm start ran at 0.7-1.8 steps/s."""
    import torch
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cores - cfg.launch.engines * cfg.launch.engine_threads))


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


class _Child:
    """An engine child process and its two queues (requests in, answers out)."""

    def __init__(self, start: Callable[[object, object, bool], RoleProcess], ctx, standby: bool):
        self.inbox, self.own = ctx.Queue(), ctx.Queue()
        self.process = start(self.inbox, self.own, standby)


class ProcessWorker:
    """An ``EngineWorker``: ``engine_process`` in a child process, answering on a queue of its
    own that a relay thread moves into the shared ``outbox`` (a child killed while writing can
    then leave nothing torn or locked in the channel the other engines share).
    ``restart()`` replaces a dead child with a new one on the same device and weight route:
    it builds the engine again and takes the newest published weights when the first request
    asks for them; the caller requeues what the dead one had in flight. On a weight broadcast
    group ``regroup`` (``BroadcastWeights.regroup``) is called first: the group re-forms with
    the new child and the writer sends it the current version. After ``keep_standby()`` a
    standby child waits, its imports done, and a restart hands over to it (then starts the
    next standby); a standby that died meanwhile is replaced by a fresh start."""

    restartable = True

    def __init__(self, engine_id: int, start: Callable[[object, object, bool], RoleProcess], ctx,
                 outbox: queue.Queue, regroup: Callable[[], int] | None = None):
        self.engine_id, self._start, self._ctx, self._outbox = engine_id, start, ctx, outbox
        self._regroup = regroup
        self.restarts = 0
        self._standby: _Child | None = None
        self._keeps_standby = False
        self._launch(_Child(start, ctx, standby=False))

    def keep_standby(self) -> None:
        """From now on a standby child waits to replace this worker's child."""
        self._keeps_standby = True
        if self._standby is None:
            self._standby = _Child(self._start, self._ctx, standby=True)

    def _launch(self, child: _Child) -> None:
        self._inbox, self._process = child.inbox, child.process
        stop = threading.Event()
        self._relay_stop = stop
        threading.Thread(target=_relay, args=(child.own, self._outbox, stop), name=f"engine{self.engine_id}-relay",
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
        child, self._standby = self._standby, None
        if child is not None and child.process.proc.is_alive():
            self._launch(child)
            child.process.take_over()
        else:
            if child is not None:
                child.process.stop(timeout=0)
            self._launch(_Child(self._start, self._ctx, standby=False))
        if self._keeps_standby:
            self.keep_standby()  # the next death's replacement

    def join(self, timeout: float) -> None:
        self._process.stop(timeout=timeout)
        self._relay_stop.set()
        if self._standby is not None:
            self._standby.process.stop(timeout=0)
            self._standby = None


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
    """``start_trainer(cfg, path, tokenizer, routes, placement, run_dir)`` returns
    a ``TrainerHandle`` (``trainer/api.py``): the ``TrainerHost`` itself
    (in-process) or a ``TrainerProxy`` that calls every trainer rank process
    (``launch.trainer_ranks``; more than one form a torch.distributed group and
    train with FSDP2) and returns rank 0's answer. A rank that raises or dies
    stops the call at once with its name. ``rank_spec(cfg, path, tokenizer, rank,
    device, rendezvous, publish_dtype)`` is the ``trainer.serve.RankSpec`` a rank is
    built from, here and under Ray (``launch/ray.py``).
    """
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


def start_engines(cfg: RunConfig, path: str, tokenizer, routes, placement: Placement, run_dir: Path,
                  restarts: EngineRestarts) -> tuple[list[EngineWorker], object, int, str]:
    """``start_engines(cfg, path, tokenizer, routes, placement, run_dir)`` returns
    the ``EngineWorker`` handles (``rollout/api.py``), the outbox they all
    answer on and the engines' context limit. In-process: one engine worker in
    a thread of this process (``ThreadWorker``). Otherwise ``launch.engines``
    child processes (``ProcessWorker``), engine i on
    ``placement.engine_devices[i]`` with ``launch.engine_threads`` CPU threads,
    reading ``routes.readers[i]``. Both run ``rollout.serve.engine_loop``.
    A child that dies is restarted (``ProcessWorker.restart``) within the run's
    budget ``restarts`` (``rollout.restarts.EngineRestarts``): by
    ``await_ready`` while the engines start, by the producer afterwards; on a
    weight broadcast group (``routes.group``) the group re-forms with it. With
    ``launch.standby_engines`` each worker keeps a standby process, started
    once the engines are ready, with the engine's imports done
    (``rollout.serve.engine_standby``): a restart hands over to it instead of
    spawning a process that imports torch and transformers first.

    Every start waits for the children to report ready, with the launch
    deadline; an engine that dies while starting is restarted like one that dies
    mid-run (past the budget the death stops the run with its log), a trainer
    rank that dies while starting is reported with its log.
    """
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

        def start(inbox, own, standby: bool, i=i, spec=spec) -> RoleProcess:
            return RoleProcess(f"engine{i}", engine_process, (spec, inbox, own, routes.readers[i], i, partial),
                               run_dir / "logs", ctx, threads=cfg.launch.engine_threads,
                               prepare=engine_standby if standby else None)
        regroup = routes.group.regroup if routes.group is not None else None
        workers.append(ProcessWorker(i, start, ctx, outbox, regroup))
    try:
        context_limit, label = await_ready(workers, outbox, cfg.launch.timeout_s, restarts)
    except BaseException:
        stop_engines(workers, timeout=0)
        raise
    if cfg.launch.standby_engines and cfg.launch.max_restarts > 0:
        for w in workers:  # now, not beside the engines' own start: it would slow theirs
            w.keep_standby()
    return workers, outbox, context_limit, f"{label} x {len(workers)}" if len(workers) > 1 else label


def await_ready(workers: list[EngineWorker], outbox: queue.Queue, timeout_s: float,
                restarts: EngineRestarts) -> tuple[int, str]:
    """Wait for every engine's ``Ready`` on ``outbox``; returns the engines' context limit and
    label. An engine that dies (or whose weights fail) while starting is restarted within
    ``restarts``, with ``timeout_s`` from its restart; past the budget its death stops the
    start, and so does any other ``Failed`` (an engine that cannot be built), naming it."""
    context_limit, label, ready = 0, "", set()
    due = {w.engine_id: time.monotonic() + timeout_s for w in workers}
    by_id = {w.engine_id: w for w in workers}
    while len(ready) < len(workers):
        for w in workers:
            try:
                w.check()
            except RoleError as dead:
                restarts.replace(w, dead, " while the engines start")
                ready.discard(w.engine_id)
                due[w.engine_id] = time.monotonic() + timeout_s
        try:
            msg = outbox.get(timeout=0.05)
        except queue.Empty:
            late = [i for i, t in due.items() if i not in ready and time.monotonic() > t]
            if late:
                raise RoleError(f"engine {late[0]} did not start within {timeout_s:g}s (launch.timeout_s; "
                                f"{len(ready)}/{len(workers)} ready); see logs/engine{late[0]}.log") from None
            continue
        if isinstance(msg, Failed):
            worker = by_id[msg.engine_id]
            if not (msg.weights and restarts.can_restart(worker)):
                raise RoleError(f"engine {msg.engine_id} failed while starting:\n{msg.traceback}")
            last = msg.traceback.strip().splitlines()[-1][:300]
            restarts.restart(worker, f"engine {msg.engine_id}: its weights failed while starting ({last})")
            due[msg.engine_id] = time.monotonic() + timeout_s
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


def stop_engines(workers: list[EngineWorker], timeout: float = 10) -> None:
    for w in workers:
        try:
            w.send(Stop())
        except (OSError, ValueError):
            pass
    for w in workers:
        w.join(timeout=timeout)
