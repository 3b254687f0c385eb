"""`conveyor train` with a generative judge as the reward (reward.fn=judge) on the tiny model: the
run completes, the judge (the random base model, which writes garbage) is counted unparseable in
the step and eval metrics, and every reward is the seeded hash fallback; a judge that cannot be
built is a one-line error before the run starts."""
import json
import subprocess
import sys

import pytest

from conveyor.cli import main
from conveyor.observe.report import read_metrics

FAST = ["sft.steps=0", "loop.steps=2", "loop.batch_size=4", "rollout.n=4", "data.eval_size=8",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "loop.time_limit_s=null", "loop.eval_every=0", "observe.tensorboard=false", "observe.progress=false",
        "observe.traces_per_step=16"]
JUDGE = ["reward.fn=judge", "reward.judge.max_new_tokens=24", "reward.judge.fallback=hash", "reward.timeout_s=60",
         "reward.max_batch=16", "reward.workers=1"]


def test_train_with_a_judge_counts_unparseable_judgements(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"--output-dir={run}", *FAST, *JUDGE]) == 0
    train = read_metrics(run, kind="train")
    assert len(train) == 2
    for m in train:
        assert m["reward_judge_fallback"] == 1.0 and m["reward_judge_parsed"] == 0.0  # all unparseable
        assert 0 < m["reward_judge_tokens"] <= 24 and m["reward_judge_tokens_per_s"] > 0
        assert m["reward_failures"] == 0 and m["reward_timeouts"] == 0 and m["reward_batches"] >= 1
    evals = read_metrics(run, kind="eval")
    assert evals and all(e["eval_judge_fallback"] == 1.0 for e in evals)
    # Every reward is the hash of the completion's text under loop.seed (0), as configured.
    from transformers import AutoTokenizer

    from conveyor.reward.judge_text import hash_score
    tok = AutoTokenizer.from_pretrained(run / "final")
    traces = [json.loads(line) for line in (run / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 2 * 16
    for t in traces:
        text = tok.decode(tok.encode(t["completion"], add_special_tokens=False), skip_special_tokens=True)
        assert t["reward"] == hash_score(text, 0)
        assert t["reward_info"]["reward_error"] == "unparseable"


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_a_judge_that_cannot_be_built_is_one_line_before_the_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={tmp_path / 'run'}", *FAST,
                        *JUDGE, "reward.judge.model=/no/such/judge"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("conveyor: error:")]
    assert len(errors) == 1 and "reward.judge.model '/no/such/judge' is not a Hugging Face checkpoint" in errors[0]
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
