"""DAPO through the whole loop: dynamic sampling in synchronous and streaming runs, its bound.

The tiny task (string reversal) after a short warm start, so that some groups score alike
and some do not. With dynamic sampling every trained group carries signal, the drops are in
the metrics, and streaming keeps its staleness bound while slots are drawn again. A run
whose groups can never differ (exact match from a model that never matches) stops on the
first step with the error that names the bound, instead of drawing forever.
"""
import math
import re
import subprocess
import sys

import pytest

from conveyor.api import load_config, train
from conveyor.observe.report import read_metrics

pytestmark = pytest.mark.slow  # whole training runs, with warm starts: `pytest -m "not slow"` leaves them out

B = 4
TINY = ["sft.steps=150", "sft.lr=3e-3", f"loop.batch_size={B}", "rollout.n=4", "data.eval_size=8",
        "loop.eval_every=0", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
        "model.tiny.intermediate_size=64", "observe.tensorboard=false", "observe.progress=false", "trainer.lr=1e-3"]
DAPO = ["algo.dynamic_sampling=true", "algo.overlong_filter=true", "rollout.max_new_tokens=8",
        "algo.overlong_buffer=2", "algo.overlong_penalty=0.5", "algo.clip_high=0.28"]


@pytest.mark.parametrize("staleness", [0, 2])
def test_dynamic_sampling_trains_only_groups_with_signal(tmp_path, staleness):
    steps = 5
    run_dir = tmp_path / f"s{staleness}"
    train(load_config(None, TINY + DAPO + [f"loop.steps={steps}", f"loop.max_staleness={staleness}"]),
          run_dir=run_dir)
    metrics = read_metrics(run_dir, kind="train")
    assert len(metrics) == steps
    dropped = kept = 0.0
    for m in metrics:
        assert m["groups_without_signal"] == 0.0, m   # every trained group's rewards differ
        assert math.isfinite(m["loss"]), m
        d, k = m["dynamic_sampling/dropped"], m["dynamic_sampling/kept"]
        assert m["dynamic_sampling/drop_frac"] == pytest.approx(d / (d + k) if d + k else 0.0)
        assert -0.5 <= m["reward_overlong_penalty"] <= 0.0, m
        assert m["staleness_max"] <= staleness, m
        dropped, kept = dropped + d, kept + k
    assert dropped > 0  # the warm-started model solves some strings for all 4 samples and fails others
    # groups reviewed since the run began: at least every trained one (later steps' may be reviewed early)
    assert kept >= B * steps - B * staleness


def test_groups_that_never_differ_stop_the_run_naming_the_bound(tmp_path):
    cmd = [sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={tmp_path / 'run'}", *TINY, "sft.steps=0",
           "reward.fn=exact", "algo.dynamic_sampling=true", "algo.max_draws_per_step=2", "loop.steps=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # one line that names the bound and the fix, not a traceback
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"^conveyor: run stopped: dynamic sampling: step 1 drew 8 groups "
                     r"\(algo.max_draws_per_step=2 x loop.batch_size=4\).*raise algo.max_draws_per_step",
                     proc.stderr, re.M), proc.stderr[-3000:]
