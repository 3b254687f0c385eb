"""The W2 benchmark harness end to end on a tiny model: conveyor and TRL, a few steps each.

Checks the shape and sanity of what a benchmark row records (no speed assertions: CPU timings
on shared cores mean nothing here).
"""
import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a whole training run or several: `pytest -m "not slow"` leaves it out

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
         "loop.batch_size=4", "rollout.n=4", "data.eval_size=16", "data.options={digits: 2, train_size: 400}"]


def _check_common(rec: dict, system: str, steps: int) -> None:
    assert rec["status"] == "ok", rec["error"]
    assert rec["system"] == system and rec["workload"] == "w2"
    assert rec["device"] and rec["device_kind"] == "cpu"
    for pkg in ("torch", "transformers", "trl", "conveyor"):
        assert rec["versions"][pkg], pkg
    assert rec["seeds"] == {"loop": 0, "data": 0, "reward": 0, "model": 0}
    assert rec["config"]["samples_per_step"] == 16 and rec["config"]["lr"] == 2e-3
    m = rec["metrics"]
    assert m["steps"] == steps and m["steady"] and m["window"] == [3, steps]
    assert m["trained_samples_per_s"] > 0 and m["median_step_s"] > 0
    assert m["rollout_tokens_per_s"] > 0 and m["training_tokens_per_s"] > 0
    assert 0.0 <= m["engine_idle_frac"] <= 1.0 and 0.0 <= m["trainer_idle_frac"] <= 1.0
    assert m["staleness"]["histogram"] == {"0": 16 * steps}          # synchronous: everything on-policy
    assert len(m["curve"]) == steps and m["curve"][-1][0] == 16 * steps
    lengths = rec["lengths"]
    assert lengths["count"] == 16 * steps and 1 <= lengths["p50"] <= lengths["p99"] <= lengths["max"] <= 6
    assert lengths["tau"] == pytest.approx(lengths["max"] / lengths["mean"])
    b = rec["bounds"]
    assert b["params"] > 0 and b["bandwidth_bytes_per_s"] is None and b["decode_bound_tokens_per_s"] is None
    assert m["mbu"] is None and m["mfu"] is None                      # no bandwidth or peak known for a CPU
    e = rec["eval"]
    assert 0.0 <= e["before"] <= 1.0 and 0.0 <= e["after"] <= 1.0
    assert e["delta"] == pytest.approx(e["after"] - e["before"])


def test_w2_harness_runs_both_systems_and_records_rows(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.setenv("CONVEYOR_BENCH_RESULTS", str(tmp_path / "results"))
    from benchmarks import w2_learning
    from conveyor.data.tiny import build_tiny
    start = build_tiny(tmp_path / "start", hidden_size=32, num_layers=1, intermediate_size=64)
    out = tmp_path / "bench"
    args = ["--out", str(out), "--warmstart", str(start), "--max-steps", "3", "--budget-s", "120", "--cpu-threads", "1",
            "--lrs", "2e-3",
            "--slack-s", "240", *[a for o in SMALL for a in ("--override", o)]]
    assert w2_learning.main(args) == 0
    conv = json.loads((out / "w2-conveyor-lr0.002-seed0.json").read_text())
    trl = json.loads((out / "w2-trl-lr0.002-seed0.json").read_text())
    _check_common(conv, "conveyor", 3)
    _check_common(trl, "trl", 3)
    assert conv["metrics"]["weight_sync_ms"] is not None and trl["metrics"]["weight_sync_ms"] is None
    # the same starting checkpoint, scored by the same evaluator
    assert conv["eval"]["before"] == trl["eval"]["before"]
    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| system | lr | seed | status |")
    assert [l.split("|")[1].strip() for l in table[2:4]] == ["conveyor", "trl"]
    assert all("| ok |" in l for l in table[2:4])
    assert not math.isnan(conv["rl_seconds"]) and conv["rl_seconds"] > 0
    # one summary line per configuration, without the per-step curve
    lines = [json.loads(l) for l in (tmp_path / "results" / "w2_cpu.jsonl").read_text().splitlines()]
    assert [r["name"] for r in lines] == ["w2-conveyor-lr0.002-seed0", "w2-trl-lr0.002-seed0"]
    assert lines[0]["metrics"]["trained_samples_per_s"] == conv["metrics"]["trained_samples_per_s"]
    assert "curve" not in lines[0]["metrics"] and lines[0]["card"] == conv["device"]


def test_trainer_benchmark_runs_two_fsdp_ranks_on_cpu(tmp_path):
    import os
    import subprocess
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trainer_gpu.py"), "--model", "tiny",
                        "--ranks", "2", "--steps", "1", "--prompts", "4", "--group", "2", "--prompt-len", "8",
                        "--max-new-tokens", "16", "--target-mean", "4", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CONVEYOR_BENCH_RESULTS": str(tmp_path / "results")})
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "trainer-tiny-r2.json").read_text())
    assert rec["ranks"] == 2 and rec["device"] == "cpu" and len(rec["times"]) == 1
    assert rec["step_s"] > 0 and rec["tokens_per_s"] == pytest.approx(rec["tokens_per_step"] / rec["step_s"])
    assert 8 * 8 < rec["tokens_per_step"] <= 8 * (8 + 16) and rec["mfu"] is None
    (summary,) = [json.loads(l) for l in (tmp_path / "results" / "trainer_cpu.jsonl").read_text().splitlines()]
    assert summary["config"]["ranks"] == 2 and summary["metrics"]["step_s"] == rec["step_s"]
