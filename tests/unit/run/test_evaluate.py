import math

from conveyor.config import RunConfig
from conveyor.run.evaluate import Evaluator


def test_no_held_out_set_reports_nan_without_generating():
    # data.eval_size=0 (the W1 benchmark): nothing is generated, scored or divided by zero
    ev = Evaluator(RunConfig(), [], prompting=None, rollouts=None, rewards=None, logger=None)
    m = ev.on([], 0.0, "eval_")
    assert list(m) == ["eval_reward"] and math.isnan(m["eval_reward"])


def test_text_in_reward_info_is_kept_out_of_the_means():
    # the code reward's per-test letters and error text ride beside its numbers
    from conveyor.reward.service import RewardService
    from conveyor.types import Task, Trajectory

    def reward(t):
        return {"reward": len(t.text) / 4, "tests_passed": float(len(t.text)), "results": "PF"[: len(t.text)],
                "error": "test 1: assert f() == 2"}

    trajs = [Trajectory(Task(f"t{i}", "q"), (1,), (2,), (0.0,), (0,), (1,), text="x" * (i + 1)) for i in range(2)]
    with RewardService(reward, timeout_s=5.0, workers=1) as svc:
        ev = Evaluator(RunConfig(), [], prompting=None, rollouts=None, rewards=svc, logger=None)
        m = ev._means(trajs, "eval_")
    assert m == {"eval_reward": 0.375, "eval_len": 1.0, "eval_tests_passed": 1.5}


def test_the_final_evaluation_of_an_evaluated_step_is_not_run_again(tmp_path):
    # A run stopped by its time limit right after a mid-run evaluation evaluates the same
    # weights again as its final one: the result is reused and logged once. Step 0 is
    # evaluated again after a warm start (new weights, same step), so it always runs.
    import json

    from conveyor.observe.metrics import MetricsLogger

    class Counting(Evaluator):
        def on(self, tasks, temperature, prefix, step=None):
            self.calls = getattr(self, "calls", 0) + 1
            return {prefix + "reward": float(self.calls)}

    with MetricsLogger(tmp_path, progress=False, tensorboard=False) as log:
        ev = Counting(RunConfig(), [], prompting=None, rollouts=None, rewards=None, logger=log)
        assert ev.evaluate(0)["eval_reward"] == 1.0
        assert ev.evaluate(0)["eval_reward"] == 2.0  # after a warm start
        assert ev.evaluate(10)["eval_reward"] == 3.0
        again = ev.evaluate(10)
        assert again == {"eval_reward": 3.0} and ev.calls == 3
        again["eval_reward"] = -1.0  # the caller's copy
        assert ev.evaluate(10)["eval_reward"] == 3.0
        assert ev.evaluate(11)["eval_reward"] == 4.0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "eval"] == [0, 0, 10, 11]


def test_a_first_evaluation_predicted_past_its_deadline_is_said_before_it_runs():
    # 8 of 80 generations are timed first; their time x 10 past launch.timeout_s is said at once.
    # The probe's time only grows on a busy machine, so the verdict does not depend on its speed.
    import threading
    import time
    from concurrent.futures import Future

    from conveyor.run.evaluate import PROBE
    from conveyor.rollout.api import SamplingParams

    class Rollouts:
        def __init__(self):
            self.sizes = []

        def request(self, prompts, params):
            self.sizes.append(len(prompts))
            fut = Future()
            threading.Timer(0.05, fut.set_result, [[]]).start()
            return fut

    class Log:
        def __init__(self):
            self.lines = []

        def message(self, text):
            self.lines.append(text)

    for timeout, said in ((0.3, True), (1e6, False)):
        cfg = RunConfig.model_validate({"launch": {"timeout_s": timeout}})
        rollouts, log = Rollouts(), Log()
        ev = Evaluator(cfg, [], prompting=None, rollouts=rollouts, rewards=None, logger=log)
        ev._predict([[1, 2]] * 80, SamplingParams())
        ev._predicted = True
        assert rollouts.sizes == [PROBE]
        assert bool(log.lines) is said
        if said:
            assert log.lines[0].startswith("the evaluation is predicted to take about ")
            assert "past launch.timeout_s=0.3: raise launch.timeout_s, or lower data.eval_size" in log.lines[0]
    rollouts = Rollouts()
    Evaluator(RunConfig(), [], prompting=None, rollouts=rollouts, rewards=None, logger=Log())._predict(
        [[1]] * PROBE, SamplingParams())
    assert rollouts.sizes == []  # nothing to predict from a set no larger than the probe
