"""Role workers: the engine's serve loop and the trainer's host, in a thread or a process.

Contract
- ``engine_loop(engine, inbox, outbox, weights, engine_id, partial)`` serves
  generation requests ``("generate", chunk_id, prompts, params)`` from
  ``inbox`` and answers ``("done", engine_id, chunk_id, completions, stats)``
  on ``outbox`` until ``("stop",)``. New weights are taken from the transport
  ``weights``: with ``partial`` (interruptible rollouts) a watcher thread
  swaps them between decode steps of a running generation (tokens after the
  swap carry the new version, the KV cache of earlier tokens is kept); without
  it, only between requests. Each swap is reported as
  ``("weights", engine_id, version, applied_at, pause_s)``. An exception is
  reported as ``("error", engine_id, traceback)`` before the loop ends.
  The same function runs in a thread (in-process roles) or as the main of a
  child process (``engine_process``), so both launch modes share one code path.
- ``TrainerHost`` wraps a trainer for ``serve_rpc`` in a child process and adds
  ``publish(version)`` (copy the weights into the shared transport).

It knows nothing of tasks, rewards or the admission rule.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback


def engine_loop(engine, inbox, outbox, weights, engine_id: int, partial: bool) -> None:
    stop = threading.Event()
    busy_s = idle_s = 0.0

    def take_weights() -> None:
        t0 = time.perf_counter()
        v = weights.poll(engine)
        if v is not None:
            outbox.put(("weights", engine_id, v, time.time(), time.perf_counter() - t0))

    def watch() -> None:
        try:
            while not stop.is_set():
                take_weights()
                time.sleep(0.002)
        except Exception:  # noqa: BLE001 - reported to the controller, which stops the run
            outbox.put(("error", engine_id, traceback.format_exc()))

    watcher = threading.Thread(target=watch, name=f"engine{engine_id}-weights", daemon=True) if partial else None
    if watcher is not None:
        watcher.start()
    try:
        while True:
            if watcher is None:
                take_weights()
            t0 = time.perf_counter()
            try:
                msg = inbox.get(timeout=0.01)
            except queue.Empty:
                idle_s += time.perf_counter() - t0
                continue
            idle_s += time.perf_counter() - t0
            if msg[0] == "stop":
                break
            chunks, stop_after = _merge_waiting(msg, inbox)
            # Weights published before these requests were admitted must be in place
            # before they start: that is what bounds staleness by the admission rule.
            take_weights()
            t0 = time.perf_counter()
            prompts = [p for _, ps, _ in chunks for p in ps]
            outs = engine.generate(prompts, chunks[0][2])
            busy_s += time.perf_counter() - t0
            i = 0
            for chunk_id, ps, _ in chunks:
                outbox.put(("done", engine_id, chunk_id, outs[i:i + len(ps)], {"busy_s": busy_s, "idle_s": idle_s}))
                i += len(ps)
            if stop_after:
                break
    except Exception:  # noqa: BLE001 - reported to the controller, which stops the run
        outbox.put(("error", engine_id, traceback.format_exc()))
    finally:
        stop.set()
        if watcher is not None:
            # A watcher still copying weights on the GPU at interpreter exit aborts the process.
            watcher.join(timeout=10)


def _merge_waiting(first, inbox) -> tuple[list[tuple], bool]:
    """The first request plus every waiting one with the same sampling settings, so that
    chunks admitted while the engine was busy decode together in one larger batch.
    (With max_staleness 0 only one chunk is ever waiting, so nothing changes.) The
    merged call uses the first chunk's seed."""
    _, chunk_id, prompts, params = first
    chunks, stop_after, held = [(chunk_id, prompts, params)], False, []
    while True:
        try:
            msg = inbox.get_nowait()
        except queue.Empty:
            break
        if msg[0] == "stop":
            stop_after = True
            break
        if chunk_id >= 0 and msg[1] >= 0 and _same_but_seed(msg[3], params):
            chunks.append((msg[1], msg[2], msg[3]))
        else:
            held.append(msg)
    for msg in held:  # evaluation requests and different settings keep their turn
        inbox.put(msg)
    return chunks, stop_after


def _same_but_seed(a, b) -> bool:
    import dataclasses
    return dataclasses.replace(a, seed=None) == dataclasses.replace(b, seed=None)


def engine_process(spec: dict, inbox, outbox, weights, engine_id: int, partial: bool) -> None:
    """Main of an engine child process: build the engine, then serve."""
    from conveyor.config import RolloutConfig
    from conveyor.rollout.factory import make_engine
    engine = make_engine(RolloutConfig.model_validate(spec["rollout"]), spec["path"])
    weights.poll(engine)
    outbox.put(("ready", engine_id, engine.context_limit))
    engine_loop(engine, inbox, outbox, weights, engine_id, partial)


class TrainerHost:
    """The trainer's object in its own process: the Trainer protocol plus publish()."""

    def __init__(self, trainer, weights):
        self.trainer, self.weights = trainer, weights

    def __getattr__(self, name):  # train, logprobs, ref_logprobs, values, export_hf, ...
        return getattr(self.trainer, name)

    def step(self) -> int:
        return self.trainer.step

    def publish(self, version: int) -> float:
        t0 = time.perf_counter()
        self.weights.publish(self.trainer.named_weights(), version)
        return time.perf_counter() - t0

    def save_checkpoint(self, path, extra):
        from conveyor.trainer.checkpoint import save_checkpoint
        save_checkpoint(self.trainer, path, extra)

    def load_checkpoint(self, path):
        from conveyor.trainer.checkpoint import load_checkpoint
        return load_checkpoint(self.trainer, path)


def trainer_process(spec: dict, conn, weights) -> None:
    """Main of the trainer child process: build the trainer, then answer calls."""
    from conveyor.config import TrainerConfig
    from conveyor.launch.procs import serve_rpc
    from conveyor.trainer.local import LocalTrainer
    trainer = LocalTrainer(spec["path"], TrainerConfig.model_validate(spec["trainer"]),
                           total_steps=spec["total_steps"], temperature=spec["temperature"],
                           pad_token_id=spec["pad_token_id"])
    conn.send(("ok", "ready"))
    serve_rpc(TrainerHost(trainer, weights), conn)
