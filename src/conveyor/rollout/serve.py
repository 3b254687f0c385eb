"""An engine worker: serves one rollout engine's inbox in a thread or a child process.

Contract: ``engine_loop(engine, inbox, outbox, weights, engine_id, partial,
timeout_s)`` serves ``messages.Generate`` from ``inbox`` until ``Stop`` and
answers on ``outbox``: ``Done`` for every prompt of a chunk exactly once,
``WeightSwap`` for every version it takes from ``weights``, ``Failed`` before
it ends on an error. A chunk's tokens never come from weights older than the
version it was admitted for. It serves by streaming (``partial`` and
``engine.streams``: one ``generate_stream`` call that chunks join between
decode steps) or in waves (one ``generate`` per group of waiting chunks);
``Memory`` (``launch.time_share``) releases or takes back the KV pool,
answered by ``MemoryDone``. ``engine_process`` is the same loop as a child
process's main; ``engine_standby`` is a standby process's wait before it is
needed. ``engine_loop``'s docstring has the details.

It knows nothing of tasks, rewards, the admission rule or how it was started.
"""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import sys
import threading
import time
import traceback

from conveyor.rollout.api import RolloutEngine, StreamChunk
from conveyor.transport.api import WeightReader
from conveyor.transport.group import WeightSyncError
from conveyor.transport.messages import (
    Done,
    EngineClock,
    Failed,
    Generate,
    Memory,
    MemoryDone,
    Ready,
    Span,
    Stop,
    WeightSwap,
)
from conveyor.transport.weights import WeightSyncTimeout

# With partial rollouts a watcher thread applies each version as it lands. Off, swaps happen
# only where the generating thread looks (before chunks enter, or between waves when idle).
WATCH_WEIGHTS = True


def engine_loop(engine: RolloutEngine, inbox, outbox, weights: WeightReader, engine_id: int, partial: bool,
                timeout_s: float = 600.0) -> None:
    """Serve ``engine`` from ``inbox`` until ``Stop``, answering on ``outbox``.

    - ``Generate(chunk_id, prompts, params, version)``: ``version`` is the weights the chunk was
      admitted for (default 0, the weights the engine was built with); the worker takes them,
      waiting up to ``timeout_s``, before the chunk starts. It answers
      ``Done(engine_id, chunk_id, completions, clock, offset, spans)``: the samples of prompts
      ``offset, offset + 1, ...``; every prompt answered exactly once. ``clock`` (``EngineClock``)
      holds ``busy_s`` (inside generation calls), ``idle_s`` and the engine's ``counters``;
      ``spans`` what the worker did since its previous ``Done`` (generate calls or a streaming
      call's stretch; waits for weights), for the timeline. Negative chunk ids are evaluation
      requests: never merged, answered whole (offset 0).
    - Each swap is ``WeightSwap(engine_id, version, applied_at, pause_s, received_at,
      announced_at)`` (when the transport held the whole version and when its writer announced
      it; None where it does not say). An error is ``Failed(engine_id, traceback, weights)``;
      ``weights`` is true for ``WeightSyncError`` / ``WeightSyncTimeout``, which the producer
      answers by replacing a restartable engine (within ``launch.max_restarts``).
    - With ``partial`` each version is applied as soon as the transport has it, and
      ``applied_at`` is stamped once the copy ran on the device. In a streaming call the
      generating thread applies it between two steps (a non-blocking ``wait_news`` check each
      step, the copy queued right before the next forward) and a watcher thread stamps it;
      otherwise the watcher applies it (woken by ``wait_news``; the engine's lock puts the copy
      between two decode steps).
    - Streaming: between decode steps the generating thread takes newly arrived chunks whose
      sampling params equal the running call's but for the seed; they join the running batch
      (each its own seed) and each prompt (a group) is reported as its own samples end. The
      first message that cannot join (an evaluation request, other params, ``Stop``) is held
      and nothing more read: the call drains, then it is served. Weights are taken right before
      new chunks enter, so a chunk admitted after version v was published never decodes with
      older weights; later tokens carry the new version, earlier KV is kept. A chunk admitted
      for a version still on its way waits outside the engine while the running rows decode on
      (only an idle engine blocks for it).
    - Waves: the first request plus every waiting one with the same params (but seed) is one
      ``engine.generate``; its chunks are reported when it returns. Without ``partial`` weights
      change only between calls, so a sample's tokens come from one version.
    - On a GPU the engine decodes on a high-priority stream of its own (``_own_stream``).
    """
    _own_stream(engine.cuda_device)
    server = _EngineServer(engine, inbox, outbox, weights, engine_id, timeout_s)
    try:
        if partial and engine.streams:
            server.serve_stream()
        else:
            server.serve_waves(partial)
    except Exception:  # noqa: BLE001 - reported to the controller, which stops the run
        outbox.put(failure(engine_id))


def failure(engine_id: int) -> Failed:
    """The ``Failed`` report of the exception being handled; a weight transport failure says so."""
    error = sys.exc_info()[1]
    return Failed(engine_id, traceback.format_exc(), isinstance(error, (WeightSyncError, WeightSyncTimeout)))


def _own_stream(device) -> None:
    """On a GPU the engine works on a high-priority stream of its own: a trainer on the same device
    (another thread of this process, a step accumulated while the engine decodes) queues on its
    own stream, and the engine's decode steps are scheduled ahead of its kernels, not behind them."""
    if device is None:
        return
    import torch
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device=device, priority=-100)  # clamped to the highest priority
    stream.wait_stream(torch.cuda.default_stream(device))  # what building the engine queued comes first
    torch.cuda.set_stream(stream)


@dataclasses.dataclass(frozen=True)
class _Swap:
    """A version swapped in whose copy may still run on the device (``done``: its CUDA event)."""
    version: int
    pause_s: float
    done: object
    received_at: float | None
    announced_at: float | None


class _EngineServer:
    """One engine's serve loop state: its queues, weight transport and busy / idle clocks."""

    def __init__(self, engine: RolloutEngine, inbox, outbox, weights: WeightReader, engine_id: int,
                 timeout_s: float):
        self.engine, self.inbox, self.outbox, self.weights = engine, inbox, outbox, weights
        self.engine_id, self.timeout_s = engine_id, timeout_s
        self.version = engine.version  # the weights it holds (0: those it was built with)
        self.busy_s = self.idle_s = 0.0
        self._taking = threading.Lock()
        self.device = engine.cuda_device  # where a watcher thread queues its copies
        self.stream = None  # the generating thread's stream, which the watcher's copies share
        if self.device is not None:
            import torch
            self.stream = torch.cuda.current_stream(self.device)
        self.held = None  # a message read while streaming that could not join the running call
        self.streaming = False  # a streaming call runs: its thread swaps weights between steps
        self._settling: queue.Queue = queue.Queue()  # swaps queued on the device, not yet stamped
        # What the generating thread did since its last report, for the run's timeline: the
        # spans travel with the next Done, so a worker in another process needs no channel.
        self.track = f"engine {engine_id}"
        self.spans: list[Span] = []

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
            swap = _Swap(v, pause, done, self.weights.received_at, self.weights.announced_at)
        if handoff:
            self._settling.put(swap)
        else:
            self._report_swap(swap)

    def _report_swap(self, swap: _Swap) -> None:
        if swap.done is not None:
            swap.done.synchronize()
        self.outbox.put(WeightSwap(self.engine_id, swap.version, time.time(), swap.pause_s, swap.received_at,
                                   swap.announced_at))

    def swap_between_steps(self) -> None:
        """On the generating thread, between two steps: apply a version that has landed. The
        copy goes on the stream right before the next step's forward, so the version waits
        neither for another thread to get the interpreter and the engine's lock nor for a
        step in flight (this thread has just synchronised with the last one)."""
        if self.weights.wait_news(self.engine, 0.0):
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
                    torch.cuda.set_stream(self.stream)  # copies ordered with the decode steps, as one stream
                while not stop.is_set():
                    if self.streaming or not self._settling.empty():
                        try:
                            self._report_swap(self._settling.get(timeout=0.05))
                        except queue.Empty:
                            pass
                        continue
                    self.take_weights(settle=True)
                    self.weights.wait_news(self.engine, 0.05)
            except Exception:  # noqa: BLE001 - reported to the controller, which stops the run
                self.outbox.put(failure(self.engine_id))

        watcher = threading.Thread(target=watch, name=f"engine{self.engine_id}-weights", daemon=True) if on else None
        if watcher is not None:
            watcher.start()
        try:
            yield
        except Exception:  # noqa: BLE001 - reported before waiting for the watcher below
            self.outbox.put(failure(self.engine_id))
        finally:
            stop.set()
            if watcher is not None:
                # A watcher still copying weights on the GPU at interpreter exit aborts the process.
                watcher.join(timeout=10)
            while not self._settling.empty():  # swaps the watcher had no time to stamp
                self._report_swap(self._settling.get())

    def take_version(self, need: int) -> None:
        """Apply weights now and, if chunks about to start were admitted for a later version
        than the engine holds (its publish may still be on the way), wait for it: no token
        of a chunk admitted for version v comes from older weights."""
        self.take_weights()
        deadline = time.monotonic() + self.timeout_s
        waited_from = time.time() if self.version < need else None
        while self.version < need:
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(
                    f"engine {self.engine_id}: weights version {need} (a chunk was admitted for it) did not "
                    f"arrive within {self.timeout_s:g}s; the engine holds version {self.version}")
            time.sleep(0.0002)
            self.take_weights()
        if waited_from is not None:
            self.spans.append(Span(self.track, "wait for weights", waited_from, time.time(), {"version": need}))

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

    def switch_memory(self, hold: bool) -> None:
        """Release or take back the engine's KV pool (``launch.time_share``), between calls."""
        t0, wall0 = time.perf_counter(), time.time()
        if hold:
            self.engine.reacquire_memory()
        else:
            self.engine.release_memory()
        seconds = time.perf_counter() - t0
        self.spans.append(Span(self.track, "take memory" if hold else "release memory", wall0, wall0 + seconds))
        self.outbox.put(MemoryDone(self.engine_id, hold, seconds))

    def report(self, chunk_id: int, completions, busy_s: float, offset: int = 0) -> None:
        clock = EngineClock(busy_s, self.idle_s, dict(self.engine.counters))
        spans, self.spans = tuple(self.spans), []
        self.outbox.put(Done(self.engine_id, chunk_id, completions, clock, offset, spans))

    # ----- waves ----------------------------------------------------------------------
    def serve_waves(self, partial: bool) -> None:
        with self.watching(partial and WATCH_WEIGHTS):
            while True:
                if not partial:
                    self.take_weights()
                msg = self.next_message()
                if msg is None:
                    continue
                if isinstance(msg, Stop):
                    break
                if isinstance(msg, Memory):
                    self.switch_memory(msg.hold)
                    continue
                chunks, stop_after = _merge_waiting(msg, self.inbox)
                # Weights published before these requests were admitted must be in place
                # before they start: that is what bounds staleness by the admission rule.
                self.take_version(max(c.version for c in chunks))
                t0, wall0 = time.perf_counter(), time.time()
                outs = self.engine.generate([p for c in chunks for p in c.prompts], chunks[0].params)
                self.busy_s += time.perf_counter() - t0
                self.spans.append(Span(self.track, _span_name(chunks[0].chunk_id), wall0, time.time(),
                                       {"prompts": sum(len(c.prompts) for c in chunks), "chunks": len(chunks)}))
                i = 0
                for c in chunks:
                    self.report(c.chunk_id, outs[i:i + len(c.prompts)], self.busy_s)
                    i += len(c.prompts)
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
                if isinstance(msg, Stop):
                    break
                if isinstance(msg, Memory):
                    self.switch_memory(msg.hold)
                    continue
                self.stream_call(msg)

    def stream_call(self, first: Generate) -> None:
        """One ``generate_stream`` call that starts with ``first`` and takes compatible chunks as they come."""
        first_id, params = first.chunk_id, first.params
        pending = [first]
        running = [0]  # prompts handed to the engine and not yet reported
        t0 = time.perf_counter()
        mark = [time.time()]  # where the timeline's current generate segment began
        evaluation: list = [None] * len(first.prompts)  # an evaluation request is answered whole
        if not first.prompts:
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
                if isinstance(msg, Generate) and not msg.prompts:
                    self.report(msg.chunk_id, [], self.busy_s)  # nothing to generate: answered at once
                elif isinstance(msg, Generate) and _joins(msg, first_id, params):
                    new.append(msg)
                else:
                    self.held = msg
            # Always right before chunks enter the engine: none of their tokens may come
            # from weights older than the version they were admitted for. (Otherwise each
            # version is swapped at the top of the first intake after it lands.)
            if new:
                need = max(c.version for c in new)
                self.take_weights(handoff=swap_here)
                if need > self.version and running[0]:
                    # Their version is still on its way: the running rows decode on and
                    # these chunks join at a later step, once it is in.
                    pending[:] = new
                    return []
                if need > self.version:  # nothing else runs: wait for it here
                    self.take_version(need)
            running[0] += sum(len(c.prompts) for c in new)
            return [StreamChunk(c.chunk_id, c.prompts, c.params.seed) for c in new]

        def on_done(chunk_id, i, samples) -> None:
            # The call is cut into segments at its reports, so each Done carries the time up to
            # it; reports of one decode step share a segment (nothing between them to show).
            now = time.time()
            if now > mark[0]:
                self.spans.append(Span(self.track, _span_name(first_id), mark[0], now, {"running": running[0]}))
                mark[0] = now
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


def _span_name(chunk_id: int) -> str:
    return "generate" if chunk_id >= 0 else "generate (eval)"


def _merge_waiting(first: Generate, inbox) -> tuple[list[Generate], bool]:
    """The first request plus every waiting one with the same sampling settings, so that
    chunks admitted while the engine was busy decode together in one larger batch.
    (With max_staleness 0 only one chunk is ever waiting, so nothing changes.) The
    merged call uses the first chunk's seed."""
    chunks, stop_after, held = [first], False, []
    while True:
        try:
            msg = inbox.get_nowait()
        except queue.Empty:
            break
        if isinstance(msg, Stop):
            stop_after = True
            break
        if _joins(msg, first.chunk_id, first.params):
            chunks.append(msg)
        else:
            held.append(msg)
    for msg in held:  # evaluation requests and different settings keep their turn
        inbox.put(msg)
    return chunks, stop_after


def _joins(msg: Generate, first_id: int, params) -> bool:
    """Whether ``msg`` may share a call with chunk ``first_id`` sampled with ``params``: neither
    is an evaluation request (negative id) and the sampling settings agree but for the seed."""
    return (first_id >= 0 and msg.chunk_id >= 0
            and dataclasses.replace(msg.params, seed=None) == dataclasses.replace(params, seed=None))


def engine_process(spec: dict, inbox, outbox, weights: WeightReader, engine_id: int, partial: bool) -> None:
    """Main of an engine child process: build the engine, then serve. An engine that cannot be
    built reports ``Failed`` (an error, which a restart would repeat); a death is the launcher's."""
    from conveyor.config import RolloutConfig
    from conveyor.rollout.factory import make_engine
    from conveyor.runtime.procs import bind_device
    try:
        bind_device(spec["device"])
        # The weight receiver and watcher threads must get the GIL from the decode loop within
        # a fraction of a millisecond, not the default 5 ms: that wait is weight-sync latency.
        sys.setswitchinterval(0.0005)
        engine = make_engine(RolloutConfig.model_validate(spec["rollout"]), spec["path"])
        weights.poll(engine, engine_id)
    except Exception:  # noqa: BLE001 - reported to the controller, which stops the run
        outbox.put(failure(engine_id))
        return
    outbox.put(Ready(engine_id, engine.context_limit, engine.label))
    engine_loop(engine, inbox, outbox, weights, engine_id, partial, spec.get("timeout_s", 600.0))


def engine_standby(spec: dict, *_) -> None:
    """What a standby engine process does before it is needed (``runtime.procs.RoleProcess``'s
    ``prepare``, with ``engine_process``'s arguments): the imports of building the engine, so a
    replacement for a dead engine starts in a fraction of the time. It touches neither the device
    nor the weight route: those are the live engine's until it dies."""
    from conveyor.config import RolloutConfig
    from conveyor.rollout.factory import prepare_engine
    prepare_engine(RolloutConfig.model_validate(spec["rollout"]), spec["path"])
