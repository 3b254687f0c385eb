"""The replay store: what it keeps, what it gives back, when, how often, and in which order."""
import pytest

from conveyor.config import ConfigError, load_config
from conveyor.config.replay import ReplayConfig
from conveyor.controller import objective
from conveyor.controller.replay import ReplayStore, spread
from conveyor.types import Group, Task, Trajectory


def group(name: str, rewards: list[float], version: int) -> Group:
    task = Task(id=name, prompt="x")
    return Group(task, tuple(Trajectory(task=task, prompt_ids=(1, 2), completion_ids=(3, 4), logprobs=(-0.5, -1.0),
                                        versions=(version, version), loss_mask=(1, 1), reward=r) for r in rewards))


def store(**kw) -> ReplayStore:
    cfg = {"fraction": 0.5, "max_age": 2, "max_uses": 1, "capacity": 16} | kw
    return ReplayStore(ReplayConfig(**cfg), batch_size=4, seed=0)


def names(mix) -> list[str]:
    return [r.group.task.id for r in mix.replayed]


def test_only_groups_with_signal_are_stored_and_fresh_groups_pass_through():
    s = store()
    fresh = [group("flat", [1.0, 1.0], 0), group("a", [0.0, 1.0], 0), group("zero", [0.0, 0.0], 0)]
    mix = s.mix(fresh, step=0)
    assert mix.fresh == fresh and mix.replayed == [] and mix.groups == fresh
    assert len(s) == 1
    assert names(s.mix([], step=1)) == ["a"]


def test_never_replayed_in_its_own_step_and_max_age_zero_never_replays():
    s = store(max_age=0)
    for step in range(4):
        mix = s.mix([group(f"g{step}", [0.0, 1.0], step)], step=step)
        assert mix.replayed == [] and len(s) == 0


def test_age_limit_counts_versions_from_the_oldest_token():
    s = store(max_age=2, max_uses=5)
    s.mix([group("v0", [0.0, 1.0], 0)], step=0)
    assert [r.age for r in s.mix([], step=1).replayed] == [1]
    assert [r.age for r in s.mix([], step=2).replayed] == [2]
    assert s.mix([], step=3).replayed == [] and len(s) == 0  # age 3 > max_age 2: gone
    # a stale fresh group (sampled 2 versions ago) is already at the limit: never stored
    s.mix([group("stale", [0.0, 1.0], 3)], step=5)
    assert len(s) == 0


def test_reuse_count_and_per_step_limit():
    s = store(max_uses=2, max_age=10)  # fraction 0.5 of batch 4: 2 groups a step
    s.mix([group(n, [0.0, 1.0], 0) for n in "abc"], step=0)
    uses = {}
    for step in range(1, 5):
        mix = s.mix([], step=step)
        assert len(mix.replayed) <= 2
        for r in mix.replayed:
            uses[r.group.task.id] = r.use
    assert uses == {"a": 2, "b": 2, "c": 2} and len(s) == 0


def test_draws_prefer_the_largest_spread_then_the_youngest():
    s = store(max_age=5)
    s.mix([group("small", [0.0, 0.2], 0), group("big-old", [0.0, 1.0], 0), group("big-new", [0.0, 1.0], 1),
           group("mid", [0.0, 0.5], 1)], step=1)
    assert names(s.mix([], step=2)) == ["big-new", "big-old"]
    assert names(s.mix([], step=3)) == ["mid", "small"]
    assert spread(group("x", [0.0, 1.0], 0)) == pytest.approx(0.5)


def test_capacity_evicts_the_lowest_spread_then_the_oldest():
    s = store(capacity=2, max_age=5, fraction=1.0)
    s.mix([group("low", [0.0, 0.1], 1), group("high-old", [0.0, 1.0], 0), group("high-new", [0.0, 1.0], 1)],
          step=1)
    assert len(s) == 2
    assert names(s.mix([], step=2)) == ["high-new", "high-old"]  # low was evicted
    s = store(capacity=2, max_age=5, fraction=1.0)
    s.mix([group("v0", [0.0, 1.0], 0), group("v2", [0.0, 1.0], 2), group("v1", [0.0, 1.0], 1)], step=2)
    assert names(s.mix([], step=3)) == ["v2", "v1"]  # equal spread: the oldest was evicted


def test_ties_are_broken_by_the_seed_deterministically():
    def order(seed):
        s = ReplayStore(ReplayConfig(fraction=1.0, max_age=3, capacity=64), batch_size=8, seed=seed)
        s.mix([group(f"g{i}", [0.0, 1.0], 0) for i in range(8)], step=0)
        return names(s.mix([], step=1))
    assert order(0) == order(0) and order(1) == order(1)
    assert sorted(order(0)) == [f"g{i}" for i in range(8)]
    assert len({tuple(order(seed)) for seed in range(6)}) > 1


def test_metrics_count_replays_and_report_the_fresh_reward():
    s = store(max_age=3)
    s.mix([group("a", [0.0, 1.0, 1.0], 0)], step=0)
    mix = s.mix([group("b", [0.0, 0.0, 0.0], 2)], step=2)
    m = mix.metrics()
    assert m["replay/groups"] == 1 and m["replay/samples"] == 3 and m["replay/store_size"] == 0
    assert m["replay/age_mean"] == 2 and m["replay/age_max"] == 2
    assert m["replay/reward"] == pytest.approx(2 / 3)
    assert m["reward"] == 0.0 and m["groups_without_signal"] == 1.0
    assert "replay/age_mean" not in s.mix([], step=3).metrics()


def test_a_replayed_group_keeps_its_behaviour_logprobs_in_the_batch():
    s = store()
    old = group("old", [0.0, 1.0], 0)
    s.mix([old], step=0)
    mix = s.mix([group("new", [1.0, 0.0], 1)], step=1)
    batch, _ = objective.make_batch(mix.groups, load_config(None, []).algo)
    assert len(batch) == 4
    assert batch.fields["behaviour_logprobs"][2].tolist() == [0.0, 0.0, -0.5, -1.0]  # prompt, then its own
    # group-relative advantages: the replayed group's equal its fresh ones (they depend on its rewards only)
    fresh, _ = objective.make_batch([old], load_config(None, []).algo)
    assert all((a == b).all() for a, b in zip(batch.fields["advantages"][2:], fresh.fields["advantages"]))


def test_config_refuses_an_uncorrected_loss_and_a_fraction_under_one_group():
    on = ["loop.replay.fraction=0.5", "loop.batch_size=4"]
    assert load_config(None, on).algo.loss == "decoupled_ppo"  # auto
    assert load_config(None, on + ["loop.replay.max_age=0"]).algo.loss == "ppo"  # replays nothing
    assert load_config(None, on + ["algo.loss=ppo", "algo.importance_sampling=truncated"]).algo.loss == "ppo"
    with pytest.raises(ConfigError, match="loop.replay needs an importance-corrected loss"):
        load_config(None, on + ["algo.loss=ppo"])
    with pytest.raises(ConfigError, match="loop.replay.fraction"):
        load_config(None, ["loop.replay.fraction=0.1", "loop.batch_size=4"])
    assert not load_config(None, []).loop.replay.enabled


def test_prepare_trains_fresh_then_replayed_groups_and_prefetch_passes_the_next_step():
    from conveyor.controller.step_batch import Prefetch, prepare
    from conveyor.data.tiny import build_model, build_tokenizer
    from conveyor.trainer.serve import TrainerHost
    from conveyor.trainer.single import LocalTrainer
    from conveyor.transport.buffer import TrajectoryBuffer
    from conveyor.transport.messages import Scored

    cfg = load_config(None, ["loop.batch_size=2", "trainer.device=cpu", "loop.replay.fraction=0.5"])
    trainer = TrainerHost(LocalTrainer(build_model(build_tokenizer(), hidden_size=32, num_layers=1, num_heads=4,
                                                   num_kv_heads=2, intermediate_size=64, seed=0),
                                       cfg.trainer, total_steps=4), writers=[])
    need = objective.needs(cfg.algo, one_update=True)
    s = ReplayStore(cfg.loop.replay, cfg.loop.batch_size, seed=0)
    step0 = [Scored(0, group("a", [0.0, 1.0], 0)), Scored(1, group("b", [1.0, 1.0], 0))]
    sb = prepare(trainer, cfg.algo, step0, need, s, step=0)
    assert [g.task.id for g in sb.groups] == ["a", "b"] and len(sb.batch) == 4 and sb.stats["replay/groups"] == 0
    buffer = TrajectoryBuffer(8)
    for item in [Scored(2, group("c", [0.0, 0.0], 1)), Scored(3, group("d", [2.0, 0.0], 1))]:
        buffer.put(item, timeout=1)
    ahead = Prefetch(trainer, buffer, cfg.algo, cfg.loop.batch_size, need, timeout_s=10, replay=s, step=1)
    sb = ahead.take(10)
    groups, batch, stats = sb.groups, sb.batch, sb.stats
    assert [g.task.id for g in groups] == ["c", "d"]  # what the loop logs and traces: the fresh groups
    assert sb.indices == (2, 3)  # at their places in the schedule
    assert len(batch) == 6 and stats["replay/groups"] == 1 and stats["replay/age_mean"] == 1
    assert stats["reward"] == pytest.approx(0.5)  # the fresh samples' mean, not the batch's
    assert batch.fields["behaviour_logprobs"][4].tolist() == [0.0, 0.0, -0.5, -1.0]  # a's, replayed
