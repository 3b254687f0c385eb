"""Every message that crosses a thread or process boundary between the controller and a role.

Contract: each message is a frozen dataclass; its fields are documented here and nowhere else,
and a receiver reads fields by name (a dispatch on the message's type, never on a tuple's first
element). The same classes travel through ``queue.Queue``, ``multiprocessing`` queues and the
RPC pipe of ``runtime.procs``: they pickle.
- Controller -> engine worker: ``Generate``, ``Memory``, ``Stop``. Engine worker -> controller:
  ``Ready``, ``Done``, ``WeightSwap``, ``MemoryDone``, ``Failed``.
- Producer -> loop: ``Scored``. Trainer -> loop (``train_and_publish``): ``Trained``. Inside
  ``Done`` and ``Trained``: ``Span`` (what a role did when, for the timeline).
- Controller <-> a child of ``serve_rpc``: ``Call``, ``Answer`` (defined in
  ``runtime/procs.py``, re-exported). Reward service <-> a reward worker process:
  ``RewardLoaded``, ``ScoreRequest``, ``ScoreReply``.

This module knows no torch, no engine and no schedule: only the shapes of what is sent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.runtime.procs import Answer, Call
from conveyor.types import Completion, Group, Outcome, SamplingParams, Trajectory


@dataclass(frozen=True)
class Generate:
    """Generate ``params.n`` samples for each of ``prompts`` (token ids).

    chunk_id: the chunk's first place in the schedule (>= 0: training rollouts, which may be
        merged with other chunks and answered prompt by prompt); negative: an evaluation
        request, never merged and answered whole.
    version: the policy version the chunk was admitted for; the engine takes those weights
        (waiting up to its deadline) before the chunk's first token. 0: the weights it was built with.
    """
    chunk_id: int
    prompts: list[list[int]]
    params: SamplingParams
    version: int = 0


@dataclass(frozen=True)
class Stop:
    """Finish what runs, then end the engine worker."""


@dataclass(frozen=True)
class Memory:
    """Release (``hold`` False) or take back (True) the engine's KV pool (``launch.time_share``):
    sent only while the engine runs nothing; a Generate after a take-back finds the pool held."""
    hold: bool


@dataclass(frozen=True)
class MemoryDone:
    """The engine released or took back its KV pool, in ``seconds`` of its own time."""
    engine_id: int
    hold: bool
    seconds: float


@dataclass(frozen=True)
class Ready:
    """An engine process is built and holds its first weights; ``context_limit``: its context in tokens."""
    engine_id: int
    context_limit: int
    label: str  # the engine's own description (backend, runner, device)


@dataclass(frozen=True)
class EngineClock:
    """An engine worker's totals since it started.

    busy_s: seconds inside generation calls; idle_s: seconds waiting for work;
    counters: the engine's decode-step totals (``decode_steps``, ``decode_rows``, ``decode_s``,
        ``prefill_s``, ``device_wait_s``: the host blocked until the device's tokens were ready,
        and ``decode_s`` split by the rows of the steps: ``rows_key(rows)``) where it keeps them,
        else empty.
    """
    busy_s: float = 0.0
    idle_s: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)


ROWS_KEY = "decode_s_rows_le_"


def rows_key(rows: int) -> str:
    """The counter of decode seconds spent in steps of ``rows`` rows: ``decode_s_rows_le_B``, B the
    smallest power of two >= rows."""
    return f"{ROWS_KEY}{1 << max(0, rows - 1).bit_length()}"


@dataclass(frozen=True)
class Span:
    """Something a role did, for the run's timeline (``observe.timeline``): ``name`` ran on
    ``track`` (an engine, a trainer rank) from ``start`` to ``end``, wall time (``time.time()``);
    ``args``: a few numbers or words shown with it."""
    track: str
    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Done:
    """Completions of prompts ``offset, offset + 1, ...`` of chunk ``chunk_id`` (one list of
    ``params.n`` samples per prompt). Every prompt of a chunk is answered exactly once.
    ``spans``: what the engine worker did since its last report (generate calls, waits for
    weights), carried here so that a worker in another process needs no channel of its own."""
    engine_id: int
    chunk_id: int
    completions: list[list[Completion]]
    clock: EngineClock
    offset: int = 0
    spans: tuple[Span, ...] = ()


@dataclass(frozen=True)
class WeightSwap:
    """An engine now serves ``version``.

    applied_at: wall time (``time.time()``) once the copy had run on the engine's device;
    pause_s: how long the swapping thread spent in the transport's ``poll``;
    received_at / announced_at: when the transport held the whole version and when its writer
        announced it (wall time), None where the transport does not say.
    """
    engine_id: int
    version: int
    applied_at: float
    pause_s: float
    received_at: float | None = None
    announced_at: float | None = None


@dataclass(frozen=True)
class Failed:
    """An engine worker raised; ``traceback`` is its formatted traceback. The run stops, unless
    ``weights``: the engine's weight transport failed (a receive that broke or a version that did
    not arrive in time, ``WeightSyncError`` / ``WeightSyncTimeout``); then a restartable engine is
    replaced like a dead one, within ``launch.max_restarts``, and the replacement joins the weight
    group anew."""
    engine_id: int
    traceback: str
    weights: bool = False


@dataclass(frozen=True)
class Scored:
    """A complete, scored group; ``index`` is its admission index (the loop trains in that order)."""
    index: int
    group: Group


@dataclass(frozen=True)
class Trained:
    """One train call whose weights were published: the step's ``metrics``, ``step_ended`` (when
    its optimizer work was done, ``time.time()``), ``publish_s`` (host seconds spent publishing)
    and ``spans`` (the train and publish spans of every rank, for the timeline)."""
    metrics: dict[str, float]
    step_ended: float
    publish_s: float
    spans: tuple[Span, ...] = ()


@dataclass(frozen=True)
class RewardLoaded:
    """A reward worker process loaded its reward (``error`` empty) or could not (``error``: one
    line saying why); ``name`` is the reward's name for logs; ``max_batch`` is a batched reward's
    (``reward.api.BatchReward``) most trajectories per call, 0 for a per-trajectory reward."""
    pid: int
    name: str = ""
    error: str = ""
    max_batch: int = 0


@dataclass(frozen=True)
class ScoreRequest:
    """Score ``trajs`` in one call (one trajectory for a per-trajectory reward); ``seq``
    identifies the call in the answer."""
    seq: int
    trajs: tuple[Trajectory, ...]


@dataclass(frozen=True)
class ScoreReply:
    """The ``outcomes`` of request ``seq``, one per trajectory in order (``types.Outcome``,
    each problem without the exception object), and when the call started and ended
    (``time.time()``)."""
    seq: int
    outcomes: tuple[Outcome, ...]
    started_at: float
    ended_at: float
