"""Composite rewards: weights, gates, per-component values, failures, config and metrics."""
import logging
import math
from pathlib import Path

import pytest

from conveyor.config import ConfigError, RewardConfig, load_config
from conveyor.controller.step_stats import rollout_stats
from conveyor.plugins import PluginError
from conveyor.reward.calls import WrongType
from conveyor.reward.compose import Composite, Part
from conveyor.reward.factory import RewardSpec, reward_service, reward_spec
from conveyor.reward.service import RewardService
from conveyor.types import Group, Task, Trajectory

ROOT = Path(__file__).resolve().parents[3]
W = "tests.unit.reward.worker_rewards:"


def traj(text: str, answer: str | None = "42", i: int = 0) -> Trajectory:
    return Trajectory(Task(f"t{i}", "q", answer), (1,), (5,), (-0.5,), (0,), (1,), text=text)


FORMAT_THEN_MATH = (Part("format", "format", weight=0.5, gate=1.0), Part("math", "math", weight=2.0))


@pytest.mark.parametrize("text, expected", [
    # Formatted and right: 0.5 * 1 + 2 * 1; math's own "parsed" kept under its name.
    ("so \\boxed{42}", {"reward": 2.5, "format": 1.0, "math": 1.0, "math/parsed": 1.0, "gated": 0.0}),
    ("so \\boxed{41}", {"reward": 0.5, "format": 1.0, "math": 0.0, "math/parsed": 1.0, "gated": 0.0}),
    # Not formatted: the gate stops before math (absent, not 0), the total is what format gave.
    ("it is 42", {"reward": 0.0, "format": 0.0, "gated": 1.0}),
])
def test_weights_gates_and_each_components_value(text, expected):
    assert Composite(FORMAT_THEN_MATH)(traj(text)) == expected


def test_a_gate_stops_later_components_from_running():
    # math raises on a task without a gold answer: behind a failed gate it is never called.
    fn = Composite(FORMAT_THEN_MATH)
    assert fn(traj("no box", answer=None)) == {"reward": 0.0, "format": 0.0, "gated": 1.0}
    with pytest.raises(ValueError, match="has no gold answer") as e:
        fn(traj("\\boxed{1}", answer=None))
    assert "in reward component 'math' (math)" in e.value.__notes__


def test_without_gates_every_component_runs_and_there_is_no_gated_key():
    three = Part("three", W + "returns", {"value": {"reward": 3.0, "chars": 3}}, weight=0.25)
    fn = Composite((Part("fmt", "format", {"pattern": "b"}, weight=-1.0), three))
    assert fn(traj("abc")) == {"reward": -1.0 + 0.25 * 3, "fmt": 1.0, "three": 3.0, "three/chars": 3}
    assert fn(traj("xyz")) == {"reward": 0.75, "fmt": 0.0, "three": 3.0, "three/chars": 3}
    assert fn.__name__ == "compose(fmt+three)"


def test_a_failing_component_is_one_counted_failure_of_the_whole(caplog):
    parts = (Part("format", "format", weight=1.0), Part("boom", W + "raises"))
    with caplog.at_level(logging.WARNING, logger="conveyor.reward.service"):
        with RewardService(Composite(parts), timeout_s=5.0, fallback=-1.0, workers=1) as svc:
            out = svc.score([traj("\\boxed{1}", i=i) for i in range(3)])
            stats = svc.stats()
    assert [(t.reward, t.reward_info) for t in out] == [(-1.0, {"reward_error": "raised KeyError"})] * 3
    assert stats["failures"] == 3 and stats["scored"] == 3
    [record] = [r for r in caplog.records if "raised KeyError" in r.getMessage()]
    assert record.getMessage().startswith("reward 'compose(format+boom)' raised KeyError on task 't0'")
    assert "in reward component 'boom'" in "".join(record.exc_info[1].__notes__)


def test_wrong_types_raise_and_nan_counts_as_nonfinite():
    wrong = Composite((Part("s", W + "returns", {"value": "1.0"}),))
    with pytest.raises(WrongType, match="returned a str"):
        wrong(traj("x"))
    nan = (Part("v", W + "returns", {"value": math.nan}, gate=0.5), Part("one", W + "returns"))
    with RewardService(Composite(nan), timeout_s=5.0, fallback=0.0, workers=1) as svc:
        [out] = svc.score([traj("x")])
        assert out.reward_info["reward_error"] == "nonfinite" and svc.stats()["nonfinite"] == 1


def test_batched_components_are_refused():
    with pytest.raises(PluginError, match="component 'b' .* scores batches"):
        Composite((Part("b", W + "Batched"),))


@pytest.mark.parametrize("overrides, needle", [
    (["reward.fn=math"], "reward.components replaces reward.fn and reward.kwargs"),
    (["reward.kwargs={pattern: x}"], "reward.components replaces reward.fn and reward.kwargs"),
    (["reward.components=[{fn: format}, {fn: 'pkg.mod:format'}]"], "several components are named format"),
    (["reward.components=[{fn: format, name: std}]"], "component name 'std'"),
    (["reward.components=[{fn: format, name: a/b}]"], "component name 'a/b'"),
    (["reward.components=[{fn: format, weight: .inf}]"], "weight and gate must be finite"),
    (["reward.components=[{kwargs: {}}]"], "reward.components.0.fn"),
])
def test_bad_components_are_config_errors(overrides, needle):
    base = ["reward.components=[{fn: format}]"] if not overrides[0].startswith("reward.components") else []
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, *overrides])
    assert needle in str(e.value)


def test_the_config_gives_the_spec_with_default_names():
    cfg = load_config(None, ["reward.components=[{fn: format, weight: 0.1, gate: 1}, "
                             "{fn: 'conveyor.data.synthetic:partial_credit'}]"]).reward
    spec = reward_spec(cfg, "math")
    assert spec == RewardSpec("compose", parts=(Part("format", "format", weight=0.1, gate=1.0),
                                                Part("partial_credit", "conveyor.data.synthetic:partial_credit")))
    assert spec.name == "compose(format+partial_credit)"
    assert reward_spec(RewardConfig(), "math") == RewardSpec("math")
    assert reward_spec(RewardConfig(fn="exact", kwargs={"strip": False}), "math") == \
        RewardSpec("exact", {"strip": False})


def test_a_composite_runs_in_worker_processes_as_in_threads(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    cfg = RewardConfig(components=[{"fn": "format", "weight": 0.5, "gate": 1.0}, {"fn": "math", "weight": 2.0}],
                       workers=2)
    spec = reward_spec(cfg, "unused")
    trajs = [traj(t, i=i) for i, t in enumerate(["\\boxed{42}", "\\boxed{7}", "42"])]
    with reward_service(cfg, spec) as threads:
        by_threads = threads.score(trajs)
    with reward_service(cfg.model_copy(update={"executor": "process"}), spec) as procs:
        by_procs = procs.score(trajs)
        assert procs.name == "compose(format+math)"
    assert [(t.reward, t.reward_info) for t in by_procs] == [(t.reward, t.reward_info) for t in by_threads]
    assert [t.reward for t in by_procs] == [2.5, 0.5, 0.0]


def test_component_values_become_step_metrics():
    fn = Composite(FORMAT_THEN_MATH)
    trajs = [traj(t).with_reward(0.0, {k: v for k, v in fn(traj(t)).items() if k != "reward"})
             for t in ("\\boxed{42}", "\\boxed{41}", "42", "\\boxed{42}")]
    stats = rollout_stats([Group(trajs[0].task, tuple(trajs))], step=0)
    assert stats["reward_format"] == 0.75
    assert stats["reward_math"] == pytest.approx(2 / 3)  # over the three that passed the gate
    assert stats["reward_gated"] == 0.25
