"""The W1 benchmark's streaming row under the Ray launcher (``--async-override launch.backend=ray``)
on the session's loopback cluster, at the CPU smoke shape: the row is recorded and its run ran its
roles as Ray actors (the run directory has ``ray_placement.json``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a Ray cluster and a whole benchmark run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def test_w1_streaming_row_runs_on_ray(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_BENCH_RESULTS", str(tmp_path / "results"))
    from benchmarks import w1_throughput
    out = tmp_path / "bench"
    args = ["--model", "tiny", "--prompt-len", "16", "--max-new-tokens", "32", "--target-mean", "12",
            "--prompts", "4", "--group", "4", "--steps", "4", "--systems", "conveyor", "--staleness", "1",
            "--cpu-threads", "1", "--deadline-s", "400", "--out", str(out),
            "--async-override", "launch.placement=disaggregated", "--async-override", "launch.backend=ray",
            "--async-override", f"launch.ray_address={cluster.address}"]
    assert w1_throughput.main(args) == 0
    (rec_path,) = [p for p in out.glob("w1-tiny-conveyor-*.json")]
    rec = json.loads(rec_path.read_text())
    assert rec["status"] == "ok", rec.get("error")
    assert "backend=ray" in rec["setting"]["label"]
    assert rec["metrics"]["steps"] == 4 and rec["metrics"]["trained_samples_per_s"] > 0
    placed = json.loads((out / rec["name"] / "ray_placement.json").read_text())
    assert set(placed) == {"trainer0", "engine0"}
