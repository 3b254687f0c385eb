"""reasoning-gym datasets as a task source, their own scorers as the reward, and data.source."""
import json
import random
import sys

import pytest

from conveyor.config import DataConfig, RunConfig
from conveyor.data import reasoning_gym as rgs
from conveyor.data.api import DataError, TaskSource
from conveyor.data.reasoning_gym import reasoning_gym_reward, reasoning_gym_source
from conveyor.reward.api import load_reward
from conveyor.run.session import load_sources
from conveyor.types import Task, Trajectory


def traj(task: Task, text: str) -> Trajectory:
    return Trajectory(task, (1,), (), (), (), (), text=text)


def prompts(source) -> list[str]:
    return [source[i].prompt for i in range(len(source))]


def test_train_and_eval_are_distinct_and_deterministic():
    train = reasoning_gym_source("basic_arithmetic", "train", {"size": 40}, eval_size=16, seed=3)
    ev = reasoning_gym_source("basic_arithmetic", "eval", {"size": 40}, eval_size=16, seed=3)
    assert isinstance(train, TaskSource) and (len(train), len(ev)) == (40, 16)
    assert not set(prompts(train)) & set(prompts(ev))
    assert len({t.id for t in train} | {t.id for t in ev}) == 56
    again = reasoning_gym_source("basic_arithmetic", "train", {"size": 40}, eval_size=16, seed=3)
    assert [(t.prompt, t.answer, t.info) for t in again] == [(t.prompt, t.answer, t.info) for t in train]
    other = reasoning_gym_source("basic_arithmetic", "train", {"size": 40}, eval_size=16, seed=4)
    assert prompts(other) != prompts(train)
    task = train[5]
    assert task.info["rg_dataset"] == "basic_arithmetic"
    assert json.loads(json.dumps(dict(task.info))) == task.info  # the entry's address, JSON-safe
    assert train.default_reward == "conveyor.data.reasoning_gym:reasoning_gym_reward"


def test_small_problem_spaces_redraw_train_questions_that_are_eval_questions():
    # coin_flip has a few hundred distinct questions: different seeds share many of them
    train = reasoning_gym_source("coin_flip", "train", {"size": 200}, eval_size=32, seed=0)
    ev = reasoning_gym_source("coin_flip", "eval", {}, eval_size=32, seed=0)
    shared = sum(p in set(prompts(ev)) for p in prompts(train))
    assert train.stats["redrawn"] > 0
    assert shared == train.stats["eval_overlap"] == 0


@pytest.mark.parametrize("name", ["basic_arithmetic", "leg_counting", "spell_backward"])
def test_reward_is_the_datasets_own_score(name):
    source = reasoning_gym_source(name, "train", {"size": 10}, eval_size=4, seed=1)
    task = source[3]
    assert task.answer
    assert reasoning_gym_reward(traj(task, f"Let me think.\n<answer> {task.answer} </answer>")) == \
        {"reward": 1.0, "tagged": 1.0}
    assert reasoning_gym_reward(traj(task, "<answer>12345678987</answer>"))["reward"] == 0.0
    # no tags: the whole completion is the answer, unless the tags are required
    assert reasoning_gym_reward(traj(task, f"{task.answer}\n")) == {"reward": 1.0, "tagged": 0.0}
    assert reasoning_gym_reward(traj(task, str(task.answer)), require_tag=True)["reward"] == 0.0
    # what the warm start shows scores 1.0
    assert reasoning_gym_reward(traj(task, source.demonstration(task, random.Random(0))))["reward"] == 1.0


def test_reward_rebuilds_the_entry_in_a_fresh_worker_from_a_task_built_by_hand():
    task = reasoning_gym_source("leg_counting", "train", {"size": 10, "min_animals": 2, "max_animals": 3},
                                eval_size=2, seed=7)[4]
    rgs._dataset.cache_clear()
    rgs._entry.cache_clear()
    by_hand = Task("anything", "q", None, json.loads(json.dumps(dict(task.info))))
    assert reasoning_gym_reward(traj(by_hand, f"<answer>{task.answer}</answer>"))["reward"] == 1.0
    bound = load_reward("conveyor.data.reasoning_gym:reasoning_gym_reward", {"tag": "final"})
    assert bound(traj(by_hand, f"<final>{task.answer}</final>"))["reward"] == 1.0


def test_partial_credit_is_the_datasets_and_a_scorer_that_raises_scores_zero():
    task = reasoning_gym_source("prime_factorization", "train", {"size": 4}, eval_size=0, seed=0)[0]
    ref = task.info["rg_entry"]
    ds = rgs._dataset("prime_factorization", ref["seed"], ref["size"], rgs._options_key(ref["options"]))
    own = ds.score_answer("2 × 3", ds[ref["index"]])
    assert 0.0 < own < 1.0  # this scorer gives a little credit for a well-formed wrong factorization
    assert reasoning_gym_reward(traj(task, "<answer>2 × 3</answer>"))["reward"] == own
    assert reasoning_gym_reward(traj(task, "<answer>many</answer>")) == \
        {"reward": 0.0, "tagged": 1.0, "scorer_error": 1.0}


def test_reward_without_the_entry_address_names_the_fix():
    with pytest.raises(ValueError, match="task 't9' has no info.*reasoning_gym:<name>"):
        reasoning_gym_reward(traj(Task("t9", "q", "1"), "1"))


def test_unknown_dataset_and_bad_options_are_one_line_errors():
    with pytest.raises(DataError) as e:
        reasoning_gym_source("basic_arithmetics", "train", {}, 4, 0)
    msg = str(e.value)
    assert "\n" not in msg and "basic_arithmetic" in msg and "reasoning_gym.factory" in msg and "DATASETS" in msg
    with pytest.raises(DataError, match="bogus.*min_terms"):
        reasoning_gym_source("basic_arithmetic", "train", {"bogus": 1}, 4, 0)
    with pytest.raises(DataError, match="max_terms must be >= min_terms"):
        reasoning_gym_source("basic_arithmetic", "train", {"min_terms": 5, "max_terms": 2}, 4, 0)
    with pytest.raises(DataError, match="data.seed"):
        reasoning_gym_source("basic_arithmetic", "train", {"seed": 5}, 4, 0)


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(DataError, match="pip install reasoning-gym"):
        reasoning_gym_source("basic_arithmetic", "train", {}, 4, 0)


def test_data_source_reasoning_gym_loads_through_the_run():
    cfg = RunConfig(data=DataConfig(source="reasoning_gym:basic_arithmetic", eval_size=6, seed=2,
                                    options={"size": 12}, prompt_template="Q: {prompt}"))
    train, ev = load_sources(cfg, tokenizer=None)
    assert (len(train), len(ev)) == (12, 6)
    plain = reasoning_gym_source("basic_arithmetic", "train", {"size": 12}, 6, 2)
    assert train[0].prompt == "Q: " + plain[0].prompt and train[0].info == plain[0].info
    assert load_reward(train.default_reward)(traj(ev[0], f"<answer>{ev[0].answer}</answer>"))["reward"] == 1.0
