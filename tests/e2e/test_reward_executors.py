"""`conveyor train` with a composite reward scored by worker processes: each component a metric of
every step, the workers' counters logged, and bad reward config as one line before the run."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # whole training runs (tens of seconds each on a CPU)

FAST = ["sft.steps=3", "sft.batch_size=8", "loop.batch_size=4", "rollout.n=4", "data.eval_size=16",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "loop.time_limit_s=null", "loop.eval_every=0", "observe.tensorboard=false", "observe.progress=false"]
COMPONENTS = ('reward.components=[{fn: format, kwargs: {pattern: "[a-z]"}, weight: 0.5, gate: 1}, '
              '{fn: "conveyor.data.synthetic:partial_credit"}]')


def _run(args):
    return subprocess.run([sys.executable, "-m", "conveyor.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_components_are_step_metrics_with_process_workers(tmp_path):
    run = tmp_path / "run"
    r = _run(["train", "loop.steps=2", f"--output-dir={run}", *FAST, "reward.executor=process", COMPONENTS])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        # The gate: a trajectory failing format (weight 0.5) scores 0 and partial_credit is not run.
        assert 0.0 <= m["reward_format"] <= 1.0 and m["reward_gated"] == pytest.approx(1.0 - m["reward_format"])
        assert 0.0 <= m["reward_partial_credit"] <= 1.0 and "reward_partial_credit/exact" in m
        assert m["reward_worker_deaths"] == 0 and m["reward_restarts"] == 0 and m["reward_failures"] == 0
        assert m["reward_scored"] > 0
    evals = [m for m in lines if m["kind"] == "eval"]
    assert evals and all("eval_format" in m and "eval_partial_credit" in m for m in evals)


@pytest.mark.parametrize("args, needle", [
    (["reward.executor=process", "reward.fn=nowhere.module:fn"],
     "reward 'nowhere.module:fn' cannot be loaded in a reward worker process: reward 'nowhere.module:fn': "
     "cannot import module 'nowhere.module'"),
    (["reward.fn=math", COMPONENTS], "reward.components replaces reward.fn and reward.kwargs"),
])
def test_bad_reward_config_is_one_line_before_the_run(tmp_path, args, needle):
    r = _run(["train", f"--output-dir={tmp_path / 'run'}", *FAST, *args])
    assert r.returncode == 2, r.stderr[-2000:]
    err_lines = [line for line in r.stderr.splitlines() if line.startswith("conveyor: error:")]
    assert len(err_lines) == 1 and needle in err_lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or \
        "train" not in (tmp_path / "run" / "metrics.jsonl").read_text()
