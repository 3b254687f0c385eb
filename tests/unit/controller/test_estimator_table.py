"""One table of advantage estimators (``config.estimators.ESTIMATORS``): a new estimator is one
function and one row, and the config, the overlap check and the batch all take it from there."""
import pytest
import torch

from conveyor import algo
from conveyor.config import ConfigError, load_config
from conveyor.config.estimators import ESTIMATORS, Estimator, estimator
from conveyor.controller import objective
from conveyor.types import Group, Task, Trajectory


def _group(name: str, rewards: list[float]) -> Group:
    task = Task(id=name, prompt="x")
    return Group(task, tuple(Trajectory(task=task, prompt_ids=(5, 6), completion_ids=(9, 9), logprobs=(-0.5, -0.5),
                                        versions=(0, 0), loss_mask=(1, 1), finish_reason="stop", reward=r)
                             for r in rewards))


def _ranks(x: algo.AdvantageInputs):
    """A made-up estimator: each sample's rank within its group, minus the group's mean rank."""
    r = x.rewards.view(-1, x.group_sizes[0])
    ranks = r.argsort(dim=1).argsort(dim=1).float()
    return algo.expand_to_tokens((ranks - ranks.mean(dim=1, keepdim=True)).reshape(-1), x.mask), None


@pytest.fixture
def ranks_row(monkeypatch):
    row = Estimator("ranks", _ranks, group=True)
    monkeypatch.setitem(ESTIMATORS, row.name, row)  # the one place a new estimator is registered
    return row


def test_a_new_row_is_accepted_by_the_config_and_the_overlap_check(ranks_row):
    cfg = load_config(None, ["algo.advantage=ranks", "loop.accumulate_groups=2"])  # a group estimator: parts
    assert cfg.algo.advantage == "ranks" and estimator("ranks") is ranks_row
    assert not objective.needs(cfg.algo).values


def test_a_new_row_computes_the_batchs_advantages(ranks_row):
    cfg = load_config(None, ["algo.advantage=ranks"]).algo
    batch, stats = objective.make_batch([_group("a", [0.0, 1.0, 0.5]), _group("b", [3.0, 2.0, 1.0])], cfg)
    assert [a[2:].tolist() for a in batch.advantages] == [[-1.0] * 2, [1.0] * 2, [0.0] * 2,
                                                          [1.0] * 2, [0.0] * 2, [-1.0] * 2]
    assert [a[:2].tolist() for a in batch.advantages] == [[0.0, 0.0]] * 6  # the prompt gets none
    assert stats["adv_abs_mean"] == pytest.approx(4 / 6)


def test_a_critic_row_needs_a_critic_and_a_values_pass(monkeypatch):
    monkeypatch.setitem(ESTIMATORS, "valued", Estimator("valued", _ranks, critic=True))
    with pytest.raises(ConfigError, match="algo.advantage=valued needs a value model: set trainer.critic=true"):
        load_config(None, ["algo.advantage=valued"])
    with pytest.raises(ConfigError, match="algo.advantage=valued needs the whole batch"):
        load_config(None, ["algo.advantage=valued", "trainer.critic=true", "loop.accumulate_groups=2"])
    cfg = load_config(None, ["algo.advantage=valued", "trainer.critic=true"]).algo
    assert objective.needs(cfg).values and objective.PolicyLoss(cfg).needs.values


def test_an_unknown_estimator_is_one_line_naming_the_rows():
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'grp' \(did you mean 'grpo'\?\); "
                                          r"use one of grpo, drgrpo, rloo, reinforce\+\+, gae"):
        load_config(None, ["algo.advantage=grp"])
