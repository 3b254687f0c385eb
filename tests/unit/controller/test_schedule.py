"""Which places of the rollout schedule a run trained, what a checkpoint saves of it, and a
producer resumed from it: a real tiny NativeEngine served by engine_loop in a thread, the
real buffer, reward service and task cursor."""
from __future__ import annotations

import queue
import threading

import pytest

from conveyor.config import load_config
from conveyor.controller.producer import Producer, Prompting
from conveyor.controller.schedule import Ledger, ResumePoint
from conveyor.data.api import TaskCursor
from conveyor.data.synthetic import synthetic_source
from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.launch.roles import ThreadWorker
from conveyor.reward.service import RewardService
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.serve import engine_loop
from conveyor.transport.buffer import TrajectoryBuffer
from conveyor.transport.messages import Stop
from conveyor.transport.weights import StagedWeights


def test_places_trained_in_order_resume_at_the_next_step_boundary():
    ledger = Ledger(4)
    ledger.trained([0, 1, 2, 3])
    ledger.trained([4, 5, 6, 7])
    assert ledger.resume_point() == ResumePoint(2, 4, ())
    assert ledger.resume_point().start == 8


def test_places_trained_out_of_order_resume_below_the_first_owed_place():
    ledger = Ledger(4)
    ledger.trained([0, 2, 3, 8])  # step 1: place 1 still in flight, place 8 (step 3's) already in
    ledger.trained([4, 5, 6, 9])
    point = ledger.resume_point()
    assert point == ResumePoint(0, 4, (0, 2, 3, 4, 5, 6, 8, 9))
    ledger.trained([1, 7, 10, 13])
    assert ledger.resume_point() == ResumePoint(2, 4, (8, 9, 10, 13))
    assert ledger.low == 11 and ledger.above == {13}  # what is below the first owed place is forgotten
    ledger.trained([11, 12, 14, 15])
    assert ledger.resume_point() == ResumePoint(4, 4, ())


def test_a_resumed_ledger_goes_on_where_the_point_was():
    point = ResumePoint(1, 4, (4, 6, 9))
    ledger = Ledger.resumed(point)
    assert ledger.resume_point() == ResumePoint(1, 4, (4, 6, 9))
    ledger.trained([5, 7])
    assert ledger.resume_point() == ResumePoint(2, 4, (9,))  # place 8 is owed


def test_the_point_as_a_checkpoint_stores_it():
    point = ResumePoint(3, 8, (24, 25, 31))
    assert ResumePoint.from_json(point.to_json(), step=5, batch_size=8) == point
    # A checkpoint saved without one, or a resume with another batch size: its own step's boundary.
    assert ResumePoint.from_json(None, step=5, batch_size=8) == ResumePoint(5, 8, ())
    assert ResumePoint.from_json(point.to_json(), step=5, batch_size=4) == ResumePoint(5, 4, ())


def _task_length(traj) -> float:
    return float(len(traj.completion_ids))


@pytest.fixture(scope="module")
def engine_worker():
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64,
                        seed=0).eval()
    engine = NativeEngine(model, tok, device="cpu", dtype="float32", runner="fast", kv_blocks=256, max_batch=32)
    specs = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]
    weights = StagedWeights(specs)
    weights.publish(model.state_dict().items(), version=2)  # the version the resumed run publishes first
    inbox, outbox = queue.Queue(), queue.Queue()
    thread = threading.Thread(target=engine_loop, args=(engine, inbox, outbox, weights, 0, True, 60.0), daemon=True)
    thread.start()
    yield tok, ThreadWorker(0, inbox, thread), outbox
    inbox.put(Stop())
    thread.join(30)


def test_a_resumed_producer_sends_the_owed_places_and_skips_the_trained_ones(engine_worker):
    """From step 1's boundary with places 4, 6 and 9 trained, at version 2 and staleness 1: the
    producer draws places 4.. again from that boundary's data position, sends every place the
    staleness rule admits (up to 15) but those three, and each place gets the task it had."""
    tok, worker, outbox = engine_worker
    cfg = load_config(None, ["loop.batch_size=4", "loop.max_staleness=1", "rollout.n=2"])
    source = synthetic_source("reverse", "train", eval_size=8, seed=0, train_size=200)
    order = TaskCursor(source, 4, seed=0)
    order.next_batch(4)
    at_boundary = order.state_dict()
    want = {4 + i: t.id for i, t in enumerate(order.next_batch(12))}  # places 4..15
    cursor = TaskCursor(source, 4, seed=0)
    cursor.load_state_dict(at_boundary)
    buffer = TrajectoryBuffer(32)
    rewards = RewardService(_task_length, workers=2)
    producer = Producer([worker], outbox, loop=cfg.loop, timeout_s=60.0,
                        prompting=Prompting(tok, 200, False), cursor=cursor, train_size=len(source),
                        rewards=rewards, buffer=buffer, start=ResumePoint(1, 4, (4, 6, 9)), version=2,
                        sampling=lambda seed: SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=seed))
    producer.start()
    producer.start_admitting()
    try:
        got = buffer.get(9, timeout=60)
        assert {s.index: s.group.task.id for s in got} == {p: t for p, t in want.items() if p not in (4, 6, 9)}
        assert len(buffer) == 0 and producer.issued == 16  # nothing past what the rule admits
        assert producer.cursor_at(1, {}) == at_boundary
        replay = TaskCursor(source, 4, seed=0)
        replay.next_batch(12)
        assert producer.cursor_at(3, {}) == replay.state_dict()  # skipped places moved the data on too
    finally:
        producer.stop()
        rewards.close()
