"""While the trainer trains, the loop builds the next batch from groups buffered or arriving meanwhile."""
import random
import types

import pytest
import torch

from conveyor.controller import objective
from conveyor.config import load_config
from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.controller.step_batch import prepare, train_and_prepare_next
from conveyor.observe.timers import PhaseTimer
from conveyor.trainer.serve import TrainerHost
from conveyor.trainer.single import LocalTrainer
from conveyor.transport.buffer import TrajectoryBuffer
from conveyor.transport.messages import Scored
from conveyor.types import Group, Task, Trajectory

N, G = 4, 4  # groups per step, samples per group


def groups(count: int, seed: int, sizes=None):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        task = Task(id=f"t{seed}-{i}", prompt="x")
        trajs = []
        for _ in range((sizes or {}).get(i, G)):
            n = rng.randint(1, 6)
            ids = tuple(rng.randrange(8, 60) for _ in range(n))
            trajs.append(Trajectory(task=task, prompt_ids=(5, 6, 7), completion_ids=ids,
                                    logprobs=tuple(-rng.random() for _ in range(n)), versions=(0,) * n,
                                    loss_mask=(1,) * n, reward=rng.random()))
        out.append(Scored(seed * 100 + i, Group(task, tuple(trajs))))
    return out


@pytest.fixture(scope="module")
def bundle():
    cfg = load_config(None, [f"loop.batch_size={N}", "trainer.device=cpu", "launch.timeout_s=30"])
    trainer = TrainerHost(LocalTrainer(build_model(build_tokenizer(), hidden_size=32, num_layers=1, num_heads=4,
                                                   num_kv_heads=2, intermediate_size=64, seed=0),
                                       cfg.trainer, total_steps=10), writers=[])
    loss = objective.PolicyLoss(cfg.algo, norm_len=cfg.rollout.max_new_tokens, one_update=True)
    return cfg, trainer, loss


def components(cfg, trainer, items):
    buffer = TrajectoryBuffer(64)
    for item in items:
        buffer.put(item, timeout=1)
    return types.SimpleNamespace(cfg=cfg, trainer=trainer, buffer=buffer)


def prep(c, items, need):
    return prepare(c.trainer, c.cfg.algo, items, need)


def train_next(c, batch, loss, need, last=False):
    """One step through the trainer handle; returns (the step's metrics, the prefetch or None)."""
    trained, ahead = train_and_prepare_next(c.trainer, c.buffer, c.cfg.loop, c.cfg.algo, batch, loss, need,
                                            version=c.trainer.step() + 1, timeout_s=30, timer=PhaseTimer(), last=last)
    return trained.metrics, ahead


def test_the_next_batch_is_built_from_the_buffered_groups(bundle):
    cfg, trainer, loss = bundle
    need = objective.needs(cfg.algo, one_update=True)
    first, second = groups(N, 1), groups(N, 2)
    c = components(cfg, trainer, second + groups(2, 3))
    metrics, ahead = train_next(c, prep(c, first, need).batch, loss, need)
    assert metrics["num_seqs"] == N * G
    got, want = ahead.take(30), prep(c, second, need)
    assert [g.task.id for g in got.groups] == [g.task.id for g in want.groups]
    assert got.indices == want.indices == tuple(s.index for s in second)  # their places in the schedule
    assert all(torch.equal(a, b) for a, b in zip(got.batch.input_ids, want.batch.input_ids))
    assert all(torch.equal(a, b) for a, b in zip(got.batch.fields["advantages"], want.batch.fields["advantages"]))
    assert got.stats == want.stats and len(c.buffer) == 2  # the later groups stay for the step after


def test_nothing_is_taken_without_a_full_batch_or_when_the_trainer_is_needed(bundle):
    cfg, trainer, loss = bundle
    assert cfg.loop.max_staleness == 0  # synchronous: the next groups cannot arrive during training
    batch = prep(components(cfg, trainer, []), groups(N, 1), objective.needs(cfg.algo, True)).batch
    c = components(cfg, trainer, groups(N - 1, 2))
    assert train_next(c, batch, loss, objective.needs(cfg.algo, True))[1] is None
    assert len(c.buffer) == N - 1
    c = components(cfg, trainer, groups(N, 2))
    proximal = objective.Needs(proximal=True, reference=False, values=False)
    assert train_next(c, batch, loss, proximal)[1] is None and len(c.buffer) == N
    assert train_next(c, batch, loss, objective.needs(cfg.algo, True), last=True)[1] is None
    assert len(c.buffer) == N  # the last step leaves the buffer alone


def test_with_staleness_the_next_batch_waits_for_groups_that_arrive_during_training(bundle):
    cfg, trainer, loss = bundle
    cfg = cfg.model_copy(update={"loop": cfg.loop.model_copy(update={"max_staleness": 2})})
    need = objective.needs(cfg.algo, True)
    batch = prep(components(cfg, trainer, []), groups(N, 1), need).batch
    late = groups(N, 2)
    c = components(cfg, trainer, late[:-1])
    _, ahead = train_next(c, batch, loss, need)
    with pytest.raises(TimeoutError, match="launch.timeout_s"):
        ahead.take(0.2)  # one group short: still waiting, nothing lost
    c.buffer.put(late[-1], timeout=1)
    got = ahead.take(30)
    assert [g.task.id for g in got.groups] == [s.group.task.id for s in late] and len(c.buffer) == 0


def test_a_bad_next_batch_fails_after_the_step_trained(bundle):
    cfg, trainer, loss = bundle
    need = objective.needs(cfg.algo, True)
    batch = prep(components(cfg, trainer, []), groups(N, 1), need).batch
    c = components(cfg, trainer, groups(N, 2, sizes={0: G - 1}))  # unequal groups: no group advantages
    step = trainer.step()
    _, ahead = train_next(c, batch, loss, need)
    assert trainer.step() == step + 1
    with pytest.raises(ValueError, match="equal group sizes"):
        ahead.take(30)


def test_a_steps_train_and_publish_spans_reach_the_timeline(bundle, tmp_path):
    """The trainer host stamps its forward-only calls, its train call and its publish (wall time,
    its rank's row) into Trained.spans; the step records them as the trainer's on the active
    timeline."""
    import time

    from conveyor.observe import timeline
    cfg, trainer, loss = bundle
    need = objective.needs(cfg.algo, True)
    before = time.time()
    proximal = objective.Needs(proximal=True, reference=False, values=False)
    batch = prep(components(cfg, trainer, []), groups(N, 1), proximal).batch  # one trainer.logprobs call
    tl = timeline.Timeline(tmp_path)
    timeline.activate(tl)
    try:
        trained, _ = train_and_prepare_next(trainer, TrajectoryBuffer(8), cfg.loop, cfg.algo, batch, loss, need,
                                            version=trainer.step() + 1, timeout_s=30, timer=PhaseTimer(), last=True)
        after = time.time()
    finally:
        timeline.deactivate(tl)
        tl.close()
    # (forward-only calls of earlier tests on this module's trainer would come first, before ``before``)
    logprobs, train, *publishes = [s for s in trained.spans if s.start >= before]
    assert (logprobs.track, logprobs.name) == ("rank 0", "logprobs")
    assert before <= logprobs.start < logprobs.end <= train.start
    assert (train.track, train.name) == ("rank 0", "train") and publishes
    assert {(p.track, p.name) for p in publishes} == {("rank 0", "publish")}
    assert before <= train.start < train.end <= after
    assert sum(p.end - p.start for p in publishes) == pytest.approx(trained.publish_s, abs=1e-5)
    if trainer.trainer.streams_publish:  # the last optimizer step publishes group by group, inside train
        assert all(train.start <= p.start <= p.end <= train.end for p in publishes)
    else:
        assert train.end <= publishes[0].start and publishes[-1].end <= after
    assert train.end - train.start >= trained.metrics["time_s"] * 0.9  # the train call holds the optimizer work
    events = timeline.read_timeline(tmp_path)
    trainer_pid = next(e["pid"] for e in events if e.get("name") == "process_name" and e["args"]["name"] == "trainer")
    assert [e["name"] for e in events if e["ph"] == "X" and e["pid"] == trainer_pid][-2 - len(publishes):] == [
        "logprobs", "train"] + ["publish"] * len(publishes)
