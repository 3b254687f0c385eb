"""benchmarks/replay.py end to end on a tiny shape: both arms of a seed run, and the records say so."""
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two training runs in subprocesses

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
         "loop.batch_size=4", "rollout.n=4", "data.eval_size=8", "data.options={digits: 2, train_size: 400}",
         "trainer.mini_batches=1", "reward.fn=tests.unit.reward.worker_rewards:length"]


def test_replay_benchmark_pairs_the_arms_and_records_them(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_BENCH_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from benchmarks import replay
    from conveyor.data.tiny import build_tiny
    start = build_tiny(tmp_path / "start", hidden_size=32, num_layers=1, intermediate_size=64)
    out = tmp_path / "bench"
    args = ["--out", str(out), "--warmstart", str(start), "--seeds", "0", "--steps", "4", "--fraction", "0.5",
            *[a for o in SMALL for a in ("--override", o)]]
    assert replay.main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "results" / "w2_replay_cpu.jsonl").read_text().splitlines()]
    assert [r["config"]["config"] for r in rows] == ["base", "replay", "summary"]
    base, rep, summary = (r["metrics"] for r in rows)
    for m in (base, rep):
        assert m["steps"] == 4 and m["generated_samples"] == 4 * 16
    assert base["replayed_samples"] == 0 and base["replay_age_mean"] is None
    assert rep["replayed_samples"] > 0 and 1 <= rep["replay_age_mean"] <= 2  # the default max_age
    assert summary["seeds"] == [0]
    assert summary["reward_per_sample_diff_mean"] == pytest.approx(
        rep["reward_per_sample"] - base["reward_per_sample"])
    # same seed, same starting weights: both arms' first step trained on identical samples
    curves = [json.loads((out / f"{arm}-seed0" / "result.json").read_text())["curve"] for arm in ("base", "replay")]
    assert curves[0][0] == curves[1][0]
