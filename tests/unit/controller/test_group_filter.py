"""DAPO's group shaping: the soft overlong penalty, dynamic sampling's drops and bound, overlong masking."""
import pytest
import torch

from conveyor.config import ConfigError, load_config
from conveyor.controller import objective
from conveyor.controller.group_filter import (
    GroupFilter,
    NoLearningSignal,
    has_signal,
    mask_overlong,
    overlong_penalty,
)
from conveyor.types import Group, Task, Trajectory

B = 4  # groups per step


def traj(task, reward, length=3, finish="stop"):
    return Trajectory(task=task, prompt_ids=(5, 6), completion_ids=(9,) * length, logprobs=(-0.5,) * length,
                      versions=(0,) * length, loss_mask=(1,) * length, finish_reason=finish, reward=reward,
                      reward_info={"exact": reward})


def group(rewards, lengths=None, finishes=None, name="t"):
    task = Task(id=name, prompt="x")
    lengths = lengths or [3] * len(rewards)
    finishes = finishes or ["stop"] * len(rewards)
    return Group(task, tuple(traj(task, r, n, f) for r, n, f in zip(rewards, lengths, finishes)))


def make(**kw):
    args = {"batch_size": B, "budget": 8, "dynamic_sampling": True, "max_draws_per_step": 2,
            "overlong_filter": False, "overlong_buffer": 0, "overlong_factor": 1.0}
    return GroupFilter(**{**args, **kw})


def test_soft_overlong_penalty_is_linear_over_the_buffer():
    # budget 8, buffer 4: free up to 4 tokens, then -factor * (l - 4) / 4, -factor at the budget
    assert [overlong_penalty(n, 8, 4, 0.5) for n in (1, 4, 5, 6, 7, 8)] == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    assert overlong_penalty(8, 8, 0, 1.0) == 0.0  # buffer 0: off


def test_the_penalty_is_added_to_each_reward_and_reported():
    f = make(dynamic_sampling=False, overlong_buffer=2, overlong_factor=1.0)
    g = f.review(0, group([1.0, 1.0, 0.5], lengths=[6, 7, 8]))
    assert g.rewards == [1.0, 0.5, -0.5]
    assert [t.reward_info["overlong_penalty"] for t in g.trajectories] == [0.0, -0.5, -1.0]
    assert g.trajectories[0].reward_info["exact"] == 1.0  # the reward's own parts stay


def test_groups_that_score_alike_are_dropped_and_counted():
    f = make(max_draws_per_step=8)
    assert f.review(0, group([1.0, 0.0, 1.0])) is not None
    assert f.review(1, group([0.5, 0.5, 0.5])) is None
    assert f.review(2, group([0.0, 0.0, 0.0])) is None
    kept = f.review(3, group([0.2, 0.0, 0.0]))
    assert kept is not None and kept.rewards == [0.2, 0.0, 0.0]
    assert f.take_stats().metrics() == {"dynamic_sampling/kept": 2.0, "dynamic_sampling/dropped": 2.0,
                                        "dynamic_sampling/drop_frac": 0.5}
    assert f.take_stats().metrics()["dynamic_sampling/drop_frac"] == 0.0  # counted since the last call
    assert f.dropped_total == 2


def test_the_penalty_decides_the_signal():
    # rewards alike before the penalty, apart after it: the group is kept (it teaches brevity)
    f = make(overlong_buffer=2)
    g = f.review(0, group([1.0, 1.0], lengths=[3, 8]))
    assert g is not None and g.rewards == [1.0, 0.0]


def test_a_group_whose_samples_are_all_masked_carries_no_signal():
    g = group([1.0, 0.0], finishes=["length", "length"])
    assert has_signal(g, masked=False) and not has_signal(g, masked=True)
    assert make(overlong_filter=True).review(0, g) is None
    assert make(overlong_filter=True).review(0, group([1.0, 0.0], finishes=["stop", "length"])) is not None


def test_a_step_that_draws_its_whole_budget_stops_naming_the_setting():
    f = make(max_draws_per_step=2)  # 8 groups for the first step's 4 slots (indices 0-3): 4 redraws
    for _ in range(4):
        assert f.review(1, group([0.0, 0.0])) is None
    assert f.review(5, group([0.0, 0.0])) is None  # the second step has a budget of its own
    with pytest.raises(NoLearningSignal, match=r"step 1 drew 8 groups .*algo.max_draws_per_step=2.* 6 in a row"):
        f.review(2, group([1.0, 1.0]))


def test_without_dynamic_sampling_nothing_is_dropped():
    f = make(dynamic_sampling=False, overlong_buffer=1)
    assert all(f.review(i, group([0.0, 0.0])) is not None for i in range(50))


def test_overlong_filtering_masks_whole_samples_and_keeps_their_reward_in_the_baseline():
    cfg = load_config(None, ["algo.advantage=drgrpo"]).algo
    g = group([1.0, 0.0, 0.5, 0.5], lengths=[3, 8, 2, 8], finishes=["stop", "length", "stop", "length"])
    plain, _ = objective.make_batch([g], cfg)
    masked, _ = objective.make_batch([g], cfg.model_copy(update={"overlong_filter": True}))
    for i, t in enumerate(g.trajectories):
        head = torch.zeros(len(t.prompt_ids))
        want = torch.cat([head, torch.full((len(t.completion_ids),), 0.0 if t.finish_reason == "length" else 1.0)])
        assert torch.equal(masked.loss_mask[i], want)
        # the kept samples' advantages are those of the unmasked batch: the baseline still holds all four
        if t.finish_reason == "stop":
            assert torch.equal(masked.fields["advantages"][i], plain.fields["advantages"][i])
        else:
            assert float(masked.fields["advantages"][i].abs().sum()) == 0.0
    assert masked.num_tokens == 5
    assert mask_overlong(plain, list(g.trajectories)).num_tokens == 5


def test_off_by_default():
    cfg = load_config(None, [])
    a = cfg.algo
    assert not (a.dynamic_sampling or a.overlong_filter) and a.overlong_buffer == 0
    assert GroupFilter.from_config(cfg) is None


@pytest.mark.parametrize("overrides, message", [
    (["algo.dynamic_sampling=true", "rollout.n=1"], r"rollout.n=1 can never fill a batch.*raise rollout.n"),
    (["algo.dynamic_sampling=true", "algo.max_draws_per_step=1"], r"max_draws_per_step=1 leaves no draw.*2 or more"),
    (["algo.overlong_buffer=6", "rollout.max_new_tokens=6"], r"overlong_buffer \(6\) must be below rollout.max_new_tokens \(6\)"),
    (["algo.kl_in_reward=true"], r"kl_in_reward=true subtracts nothing with algo.kl_coef=0"),
])
def test_settings_that_cannot_work_are_refused_before_the_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_penalty_is_refused_for_episodes():
    with pytest.raises(ConfigError, match="with env.name set it to 0"):
        load_config(None, ["env.name=guess_number", "algo.overlong_buffer=2"])
    load_config(None, ["env.name=guess_number", "algo.overlong_filter=true"])  # filtering works with episodes


def test_the_dapo_recipe_is_the_default_task_with_dapos_parts():
    from pathlib import Path

    from conveyor.api import load_config as load_recipe

    default = load_recipe(None)
    dapo = load_recipe(Path(__file__).resolve().parents[3] / "recipes" / "dapo.yaml")
    assert dapo.data == default.data and dapo.model == default.model and dapo.sft == default.sft
    assert dapo.trainer == default.trainer and dapo.loop.batch_size == default.loop.batch_size
    a = dapo.algo
    assert a.dynamic_sampling and a.overlong_filter and a.overlong_buffer > 0 and a.loss_agg == "token-mean"
    assert a.clip_high > a.clip_low  # clip-higher
    assert GroupFilter.from_config(dapo) is not None and GroupFilter.from_config(default) is None
