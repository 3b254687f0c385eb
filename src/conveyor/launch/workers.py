"""Role workers: the engine's serve loop and the trainer's host, in a thread or a process.

Contract
- ``engine_loop(engine, inbox, outbox, weights, engine_id, partial, timeout_s)`` serves
  generation requests ``("generate", chunk_id, prompts, params, version)``
  from ``inbox`` (``version``: the weights the chunk was admitted for; the
  engine takes them, waiting up to ``timeout_s``, before the chunk starts;
  left out it is 0, the weights the engine was built with) and answers
  ``("done", engine_id, chunk_id, completions, stats, offset)`` on
  ``outbox`` until ``("stop",)``: ``completions`` are those of
  the chunk's prompts ``offset, offset + 1, ...`` (one list of samples per
  prompt); every prompt of a chunk is answered exactly once. ``stats`` holds
  ``busy_s`` (seconds inside generation calls so far), ``idle_s`` (the
  rest) and ``counters`` (the engine's step totals, if it keeps them). Negative chunk ids are evaluation requests: never merged with other
  chunks, always answered whole (offset 0). New weights
  are taken from the transport ``weights``; each swap is reported as
  ``("weights", engine_id, version, applied_at, pause_s, received_at, announced_at)``
  (when the transport held the whole version, and when its writer announced
  it; None where the transport does not say). An exception is
  reported as ``("error", engine_id, traceback)`` before the loop ends.
  With ``partial``, each version is applied as soon as the transport has it
  and ``applied_at`` is stamped once the copy has run on the device: the
  engine serves the version from then on. In a streaming call the generating
  thread applies it between two steps (a non-blocking ``wait_news`` check
  each step) and a watcher thread stamps it; otherwise the watcher applies it
  (woken by ``wait_news``; the engine's lock puts the copy between two decode
  steps).
  Two ways of serving:
  - Streaming (``partial`` and an engine with ``streams``, the native fast
    runner): continuous batching through ``engine.generate_stream``. Between
    decode steps the generating thread takes newly arrived chunks whose
    sampling params equal the running call's except the seed, and they join
    the running batch (each with its own seed); each prompt (one group) is
    reported as soon as its own samples end, so no group waits for another's
    longest sample and its rewards start while the rest of its chunk decodes. The first message
    that cannot join (an evaluation request, other params, "stop") is held
    and nothing more is read: the call drains, then the held message is
    served ("stop" ends the loop). The generating thread also takes weights
    right before new chunks enter the engine, so a chunk admitted after
    version v was published never decodes a token with older weights (the
    admission rule's staleness bound stays exact); tokens after a swap carry
    the new version, the KV cache of earlier tokens is kept. A chunk admitted for a version still on its way
    waits outside the engine while the running rows decode on, and joins at
    the first step after the version is in (only an idle engine blocks for it).
  - Waves (no ``partial``, or an engine that cannot stream): the first
    request plus every waiting one with the same params (but seed) is one
    ``engine.generate`` call; its chunks are reported when it returns. With
    ``partial`` the watcher swaps weights between decode steps; without it
    they change only between calls, so every token of a sample comes from
    one version.
  The same function runs in a thread (in-process roles) or as the main of a
  child process (``engine_process``), so both launch modes share one code path.
- ``TrainerHost(trainer, transports)`` wraps a trainer (one rank of it) for
  ``serve_rpc`` and adds ``publish(version)``: one pass over the trainer's
  weights (collective for a sharded trainer: every rank runs it) feeding the
  transports this rank writes to (possibly none); ``train_and_publish(batch,
  loss_fn, version)`` is a step whose weights leave as it ends.
- ``trainer_process`` / ``engine_process`` are the mains of the child
  processes: they bind the process to its device, join the trainer ranks'
  process group (``world`` > 1), build the role and serve.

It knows nothing of tasks, rewards or the admission rule.
"""
from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
import traceback

from conveyor.transport.weights import WeightSyncTimeout

# How often a weight watcher polls a transport that cannot wake it (wait_news).
WEIGHT_POLL_S = 0.002
# With partial rollouts a watcher thread applies each version as it lands. Off, swaps happen
# only where the generating thread looks (before chunks enter, or between waves when idle).
WATCH_WEIGHTS = True


def engine_loop(engine, inbox, outbox, weights, engine_id: int, partial: bool, timeout_s: float = 600.0) -> None:
    server = _EngineServer(engine, inbox, outbox, weights, engine_id, timeout_s)
    try:
        if partial and getattr(engine, "streams", False):
            server.serve_stream()
        else:
            server.serve_waves(partial)
    except Exception:  # noqa: BLE001 - reported to the controller, which stops the run
        outbox.put(("error", engine_id, traceback.format_exc()))


class _EngineServer:
    """One engine's serve loop state: its queues, weight transport and busy / idle clocks."""

    def __init__(self, engine, inbox, outbox, weights, engine_id: int, timeout_s: float):
        self.engine, self.inbox, self.outbox, self.weights = engine, inbox, outbox, weights
        self.engine_id, self.timeout_s = engine_id, timeout_s
        self.version = getattr(engine, "version", 0)  # the weights it holds (0: those it was built with)
        self.busy_s = self.idle_s = 0.0
        self._taking = threading.Lock()
        self.device = _cuda_device(engine)  # where a watcher thread queues its copies
        self.held = None  # a message read while streaming that could not join the running call
        self.streaming = False  # a streaming call runs: its thread swaps weights between steps
        self._settling: queue.Queue = queue.Queue()  # swaps queued on the device, not yet stamped

    def take_weights(self, settle: bool = False, handoff: bool = False) -> None:
        """Apply the newest published version if there is one, and report it. ``settle`` (a
        watcher thread, which may wait): stamp the swap once its copy has run on the device,
        the moment the engine serves the version, not when the copy was queued. ``handoff``
        (the generating thread, which must not wait): the watcher stamps it."""
        with self._taking:  # the watcher and the generating thread both take weights
            t0 = time.perf_counter()
            v = self.weights.poll(self.engine, self.engine_id)
            pause = time.perf_counter() - t0
            if v is None:
                return
            self.version = max(self.version, v)
            done = None
            if (settle or handoff) and self.device is not None:
                import torch
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
            swap = (v, pause, done, getattr(self.weights, "received_at", None),
                    getattr(self.weights, "announced_at", None))
        if handoff:
            self._settling.put(swap)
        else:
            self._report_swap(*swap)

    def _report_swap(self, v: int, pause: float, done, received_at, announced_at) -> None:
        if done is not None:
            done.synchronize()
        self.outbox.put(("weights", self.engine_id, v, time.time(), pause, received_at, announced_at))

    def swap_between_steps(self) -> None:
        """On the generating thread, between two steps: apply a version that has landed. The
        copy goes on the stream right before the next step's forward, so the version waits
        neither for another thread to get the interpreter and the engine's lock nor for a
        step in flight (this thread has just synchronised with the last one)."""
        news = getattr(self.weights, "wait_news", None)
        if news is None or news(self.engine, 0.0):
            self.take_weights(handoff=True)

    @contextlib.contextmanager
    def watching(self, on: bool):
        """While the body runs, a thread swaps weights as soon as a version arrives (the engine's
        lock puts the copy between two decode steps), so a version does not wait for the
        generating thread to look. While a streaming call runs (``self.streaming``) the
        generating thread swaps between its steps and the watcher only stamps those swaps."""
        stop = threading.Event()
        device = self.device

        def watch() -> None:
            try:
                if device is not None:
                    import torch
                    torch.cuda.set_device(device)  # the device is per thread; a new one starts on GPU 0
                wait = getattr(self.weights, "wait_news", None)
                while not stop.is_set():
                    if self.streaming or not self._settling.empty():
                        try:
                            self._report_swap(*self._settling.get(timeout=0.05))
                        except queue.Empty:
                            pass
                        continue
                    self.take_weights(settle=True)
                    if wait is None:
                        time.sleep(WEIGHT_POLL_S)
                    else:
                        wait(self.engine, 0.05)
            except Exception:  # noqa: BLE001 - reported to the controller, which stops the run
                self.outbox.put(("error", self.engine_id, traceback.format_exc()))

        watcher = threading.Thread(target=watch, name=f"engine{self.engine_id}-weights", daemon=True) if on else None
        if watcher is not None:
            watcher.start()
        try:
            yield
        except Exception:  # noqa: BLE001 - reported before waiting for the watcher below
            self.outbox.put(("error", self.engine_id, traceback.format_exc()))
        finally:
            stop.set()
            if watcher is not None:
                # A watcher still copying weights on the GPU at interpreter exit aborts the process.
                watcher.join(timeout=10)
            while not self._settling.empty():  # swaps the watcher had no time to stamp
                self._report_swap(*self._settling.get())

    def take_version(self, need: int) -> None:
        """Apply weights now and, if chunks about to start were admitted for a later version
        than the engine holds (its publish may still be on the way), wait for it: no token
        of a chunk admitted for version v comes from older weights."""
        self.take_weights()
        deadline = time.monotonic() + self.timeout_s
        while self.version < need:
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(
                    f"engine {self.engine_id}: weights version {need} (a chunk was admitted for it) did not "
                    f"arrive within {self.timeout_s:.0f}s; the engine holds version {self.version}")
            time.sleep(0.0002)
            self.take_weights()

    def next_message(self):
        """The held message, else the next one from the inbox (None after a short idle wait)."""
        if self.held is not None:
            msg, self.held = self.held, None
            return msg
        t0 = time.perf_counter()
        try:
            return self.inbox.get(timeout=0.01)
        except queue.Empty:
            return None
        finally:
            self.idle_s += time.perf_counter() - t0

    def report(self, chunk_id, completions, busy_s: float, offset: int = 0) -> None:
        stats = {"busy_s": busy_s, "idle_s": self.idle_s, "counters": dict(getattr(self.engine, "counters", {}))}
        self.outbox.put(("done", self.engine_id, chunk_id, completions, stats, offset))

    # ----- waves ----------------------------------------------------------------------
    def serve_waves(self, partial: bool) -> None:
        with self.watching(partial and WATCH_WEIGHTS):
            while True:
                if not partial:
                    self.take_weights()
                msg = self.next_message()
                if msg is None:
                    continue
                if msg[0] == "stop":
                    break
                chunks, stop_after = _merge_waiting(msg, self.inbox)
                # Weights published before these requests were admitted must be in place
                # before they start: that is what bounds staleness by the admission rule.
                self.take_version(max(c[3] for c in chunks))
                t0 = time.perf_counter()
                outs = self.engine.generate([p for _, ps, _, _ in chunks for p in ps], chunks[0][2])
                self.busy_s += time.perf_counter() - t0
                i = 0
                for chunk_id, ps, _, _ in chunks:
                    self.report(chunk_id, outs[i:i + len(ps)], self.busy_s)
                    i += len(ps)
                if stop_after:
                    break

    # ----- streaming ------------------------------------------------------------------
    def serve_stream(self) -> None:
        with self.watching(WATCH_WEIGHTS):
            while True:
                msg = self.next_message()
                if msg is None:
                    self.take_weights()  # idle: keep the engine current
                    continue
                if msg[0] == "stop":
                    break
                self.stream_call(msg)

    def stream_call(self, first) -> None:
        """One ``generate_stream`` call that starts with ``first`` and takes compatible chunks as they come."""
        first_id, prompts, params, version = _request(first)
        pending = [(first_id, prompts, params.seed, version)]
        running = [0]  # prompts handed to the engine and not yet reported
        t0 = time.perf_counter()
        evaluation: list = [None] * len(prompts)  # an evaluation request is answered whole
        if not prompts:
            self.report(first_id, [], self.busy_s)

        swap_here = WATCH_WEIGHTS  # this thread swaps between steps; the watcher stamps

        def intake() -> list:
            if swap_here:
                self.swap_between_steps()
            new, pending[:] = pending[:], []
            # An evaluation call takes nothing else; otherwise read until the first message
            # that cannot join, then stop reading so the call drains and that message is next.
            while first_id >= 0 and self.held is None:
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if msg[0] == "generate" and not msg[2]:
                    self.report(msg[1], [], self.busy_s)  # nothing to generate: answered at once
                elif msg[0] == "generate" and _joins(msg, first_id, params):
                    chunk_id, chunk_prompts, chunk_params, version = _request(msg)
                    new.append((chunk_id, chunk_prompts, chunk_params.seed, version))
                else:
                    self.held = msg
            # Always right before chunks enter the engine: none of their tokens may come
            # from weights older than the version they were admitted for. (Otherwise each
            # version is swapped at the top of the first intake after it lands.)
            if new:
                need = max(v for *_, v in new)
                self.take_weights(handoff=swap_here)
                if need > self.version and running[0]:
                    # Their version is still on its way: the running rows decode on and
                    # these chunks join at a later step, once it is in.
                    pending[:] = new
                    return []
                if need > self.version:  # nothing else runs: wait for it here
                    self.take_version(need)
            running[0] += sum(len(ps) for _, ps, _, _ in new)
            return [(chunk_id, ps, seed) for chunk_id, ps, seed, _ in new]

        def on_done(chunk_id, i, samples) -> None:
            running[0] -= 1
            busy = self.busy_s + time.perf_counter() - t0
            if chunk_id >= 0:
                self.report(chunk_id, [samples], busy, offset=i)
                return
            evaluation[i] = samples
            if all(s is not None for s in evaluation):
                self.report(chunk_id, evaluation, busy)

        self.streaming = swap_here
        try:
            self.engine.generate_stream(params, intake, on_done)
        finally:
            self.streaming = False
            self.busy_s += time.perf_counter() - t0


def _merge_waiting(first, inbox) -> tuple[list[tuple], bool]:
    """The first request plus every waiting one with the same sampling settings, so that
    chunks admitted while the engine was busy decode together in one larger batch.
    (With max_staleness 0 only one chunk is ever waiting, so nothing changes.) The
    merged call uses the first chunk's seed."""
    chunks, stop_after, held = [_request(first)], False, []
    chunk_id, params = chunks[0][0], chunks[0][2]
    while True:
        try:
            msg = inbox.get_nowait()
        except queue.Empty:
            break
        if msg[0] == "stop":
            stop_after = True
            break
        if _joins(msg, chunk_id, params):
            chunks.append(_request(msg))
        else:
            held.append(msg)
    for msg in held:  # evaluation requests and different settings keep their turn
        inbox.put(msg)
    return chunks, stop_after


def _request(msg) -> tuple:
    """``(chunk_id, prompts, params, version)`` of a generate message (version 0 if left out)."""
    return msg[1], msg[2], msg[3], msg[4] if len(msg) > 4 else 0


def _joins(msg, first_id: int, params) -> bool:
    """Whether generate request ``msg`` may share a call with chunk ``first_id`` sampled with ``params``:
    neither is an evaluation request (negative id) and the sampling settings agree but for the seed."""
    import dataclasses
    return (first_id >= 0 and msg[1] >= 0
            and dataclasses.replace(msg[3], seed=None) == dataclasses.replace(params, seed=None))


def _cuda_device(engine):
    """The GPU an engine computes on (its runner's device), or None (CPU, or not known)."""
    device = getattr(getattr(engine, "runner", None), "device", None)
    return device if getattr(device, "type", None) == "cuda" else None


def engine_process(spec: dict, inbox, outbox, weights, engine_id: int, partial: bool) -> None:
    """Main of an engine child process: build the engine, then serve."""
    from conveyor.config import RolloutConfig
    from conveyor.rollout.factory import make_engine
    _bind_device(spec["device"])
    # The weight receiver and watcher threads must get the GIL from the decode loop within
    # a fraction of a millisecond, not the default 5 ms: that wait is weight-sync latency.
    sys.setswitchinterval(0.0005)
    engine = make_engine(RolloutConfig.model_validate(spec["rollout"]), spec["path"])
    weights.poll(engine, engine_id)
    outbox.put(("ready", engine_id, engine.context_limit))
    engine_loop(engine, inbox, outbox, weights, engine_id, partial, spec.get("timeout_s", 600.0))


def _bind_device(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        # "cuda" (rollout.device / trainer.device auto) now means this GPU.
        torch.cuda.set_device(torch.device(device))


class TrainerHost:
    """The trainer's object in its own process: the Trainer protocol plus publish()."""

    def __init__(self, trainer, transports: list, publish_dtype=None):
        # publish_dtype: the same on every rank (the gathers are collective), None = float32.
        self.trainer, self.transports, self.publish_dtype = trainer, list(transports), publish_dtype

    def __getattr__(self, name):  # train, logprobs, ref_logprobs, values, export_hf, ...
        return getattr(self.trainer, name)

    def step(self) -> int:
        return self.trainer.step

    def train_and_publish(self, batch, loss_fn, version: int) -> tuple[dict, float, float]:
        """``train``, then publish ``version``, in this process: the weights leave as the optimizer
        step ends, not after a round trip through the controller (whose other threads may hold
        its GIL for milliseconds). A trainer that ``streams_publish`` runs its last optimizer
        step group by group inside the publish, so bucket k travels while bucket k + 1 is
        updated. Returns (metrics, end of the optimizer step as time.time(), publish seconds:
        host time of the publish call, the streamed optimizer's launches included)."""
        if not getattr(self.trainer, "streams_publish", False):
            metrics = self.trainer.train(batch, loss_fn)
            return metrics, getattr(self.trainer, "step_ended", 0.0) or time.time(), self.publish(version)
        from conveyor.transport.weights import publish_all
        spent = []

        def publish(named) -> None:
            t0 = time.perf_counter()
            try:  # no wait for the engines' receives, as in publish()
                publish_all(self.transports, named, version, wait=False)
            finally:
                spent.append(time.perf_counter() - t0)
        metrics = self.trainer.train(batch, loss_fn, publish=publish, publish_dtype=self.publish_dtype)
        return metrics, self.trainer.step_ended, sum(spent)

    def publish(self, version: int) -> float:
        from conveyor.transport.weights import publish_all
        t0 = time.perf_counter()
        # In the engines' dtype: a sharded trainer gathers half the bytes for bf16 engines, a
        # single-device one hands its bf16 compute copy (the masters rounded as a cast would).
        named = self.trainer.named_weights(self.publish_dtype) if self.publish_dtype else self.trainer.named_weights()
        # No wait for the engines' receives: each engine waits for the version its chunks were
        # admitted for (engine_loop), so the trainer goes back to training sooner.
        publish_all(self.transports, named, version, wait=False)
        return time.perf_counter() - t0

    def save_checkpoint(self, path, extra):
        self.trainer.save(path, extra)

    def load_checkpoint(self, path):
        return self.trainer.load(path)


def trainer_process(spec: dict, conn, transports: list) -> None:
    """Main of a trainer rank's process: bind the device, join the ranks, build, serve."""
    from datetime import timedelta

    from conveyor.config import TrainerConfig
    from conveyor.launch.procs import serve_rpc
    _bind_device(spec["device"])
    cfg = TrainerConfig.model_validate(spec["trainer"])
    kwargs = {k: spec[k] for k in ("total_steps", "temperature", "pad_token_id")}
    if spec["world"] == 1:
        from conveyor.trainer.local import LocalTrainer
        trainer = LocalTrainer(spec["path"], cfg, **kwargs)
    else:
        import torch.distributed as dist

        from conveyor.trainer.fsdp import FSDPTrainer
        backend = "nccl" if spec["device"].startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec['port']}", rank=spec["rank"],
                                world_size=spec["world"], timeout=timedelta(seconds=spec["collective_timeout_s"]))
        trainer = FSDPTrainer(spec["path"], cfg, **kwargs)
    conn.send(("ok", "ready"))
    serve_rpc(TrainerHost(trainer, transports, spec["publish_dtype"]), conn)
    for t in transports:  # a broadcast whose transfer is still running ends before the process does
        if hasattr(t, "close"):
            with contextlib.suppress(Exception):  # the engines are stopping too
                t.close()
