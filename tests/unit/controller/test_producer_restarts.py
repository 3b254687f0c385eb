"""An engine whose weights stop arriving is replaced like a dead one; any other engine error stops
the run naming it.

The engines are real (``NativeEngine`` in ``engine_loop`` threads); the worker is restartable the way
the launchers' workers are: ``restart()`` ends the old engine and starts a new one on the same
weight route, which reports ``Ready``.
"""
from __future__ import annotations

import queue
import threading

import pytest

from conveyor.config import load_config
from conveyor.controller.producer import Producer, Prompting
from conveyor.data.api import TaskCursor
from conveyor.data.synthetic import synthetic_source
from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.reward.service import RewardService
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.restarts import EngineRestarts
from conveyor.rollout.serve import engine_loop
from conveyor.runtime.errors import RoleError
from conveyor.transport.buffer import TrajectoryBuffer
from conveyor.transport.messages import Ready, Stop
from conveyor.transport.weights import StagedWeights

WAIT_S = 1.0  # how long an engine waits for the version a chunk was admitted for


class RestartableWorker:
    """``engine_loop`` in a thread; ``restart()`` stops it and starts a new engine (``on_restart``
    runs first: the test's trainer publishing the version the old engine waited for)."""

    restartable = True

    def __init__(self, model, tok, weights, outbox, on_restart=lambda: None):
        self.engine_id, self.restarts = 0, 0
        self._model, self._tok, self._weights, self._outbox = model, tok, weights, outbox
        self._on_restart = on_restart
        self._start()

    def _start(self) -> None:
        self.engine = NativeEngine(self._model, self._tok, device="cpu", dtype="float32", runner="fast",
                                   kv_blocks=256, max_batch=32)
        self._inbox = queue.Queue()
        self._thread = threading.Thread(target=engine_loop, daemon=True, args=(
            self.engine, self._inbox, self._outbox, self._weights, 0, True, WAIT_S))
        self._thread.start()

    def send(self, message) -> None:
        self._inbox.put(message)

    def check(self) -> None:
        pass  # a thread that ended has reported Failed first

    def restart(self) -> None:
        self._inbox.put(Stop())
        self._thread.join(30)
        self.restarts += 1
        self._on_restart()
        self._start()
        self._outbox.put(Ready(0, self.engine.context_limit, self.engine.label))

    def join(self, timeout: float) -> None:
        self._inbox.put(Stop())
        self._thread.join(timeout)


def _task_length(traj) -> float:
    return float(len(traj.completion_ids))


@pytest.fixture
def parts():
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64,
                        seed=0).eval()
    weights = StagedWeights([(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()])
    weights.publish(model.state_dict().items(), version=1)
    return tok, model, weights


def _producer(tok, worker, outbox, max_restarts):
    cfg = load_config(None, ["loop.batch_size=4", "loop.max_staleness=0", "rollout.n=2"])
    source = synthetic_source("reverse", "train", eval_size=8, seed=0, train_size=200)
    buffer, rewards = TrajectoryBuffer(32), RewardService(_task_length, workers=2)
    producer = Producer([worker], outbox, loop=cfg.loop, timeout_s=60.0, prompting=Prompting(tok, 200, False),
                        cursor=TaskCursor(source, 4, seed=0), train_size=len(source), rewards=rewards,
                        buffer=buffer, version=2, restarts=EngineRestarts(max_restarts),
                        sampling=lambda seed: SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=seed))
    return producer, buffer, rewards


def test_an_engine_whose_version_never_arrives_is_replaced_and_its_chunks_answered(parts):
    # Chunks admitted for version 2 reach an engine that holds version 1; version 2 is published
    # only once the engine has failed waiting for it: the replacement takes it and answers.
    tok, model, weights = parts
    outbox = queue.Queue()
    worker = RestartableWorker(model, tok, weights, outbox,
                               on_restart=lambda: weights.publish(model.state_dict().items(), version=2))
    producer, buffer, rewards = _producer(tok, worker, outbox, max_restarts=1)
    producer.start()
    producer.start_admitting()
    try:
        got = buffer.get(4, timeout=120)
        assert sorted(s.index for s in got) == [0, 1, 2, 3]
        assert worker.restarts == 1 and producer.restarts == 1
        assert all(v == 2 for s in got for t in s.group.trajectories for v in t.versions)
    finally:
        producer.stop()
        worker.join(30)
        rewards.close()


def test_past_the_restart_budget_a_weight_failure_stops_naming_the_engine(parts):
    tok, model, weights = parts
    outbox = queue.Queue()
    worker = RestartableWorker(model, tok, weights, outbox)  # version 2 never comes
    producer, buffer, rewards = _producer(tok, worker, outbox, max_restarts=0)
    producer.start()
    producer.start_admitting()
    try:
        with pytest.raises(Exception) as err:
            buffer.get(4, timeout=120)
        assert isinstance(producer.error, RoleError)
        text = str(producer.error)
        assert text.startswith("engine 0 failed:") and "weights version 2" in text, text
        assert worker.restarts == 0
    finally:
        producer.stop()
        worker.join(30)
        rewards.close()
