import math

from conveyor.config import RunConfig
from conveyor.controller.evaluate import Evaluator


def test_no_held_out_set_reports_nan_without_generating():
    # data.eval_size=0 (the W1 benchmark): nothing is generated, scored or divided by zero
    ev = Evaluator(RunConfig(), [], prompting=None, rollouts=None, rewards=None, logger=None)
    m = ev.on([], 0.0, "eval_")
    assert list(m) == ["eval_reward"] and math.isnan(m["eval_reward"])
