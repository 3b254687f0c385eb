"""W4 (a judge in the loop) end to end on the tiny W1 model: synchronous and streaming, a few steps
each, the judge on the CPU. Checks the shape and sanity of what a W4 row records (no speed
assertions: CPU timings on shared cores mean nothing here) and the judge's promises: a random
judge writes no score, so every reward is W1's seeded hash of the completion, counted unparseable."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TINY = ["--model", "tiny", "--judge-device", "cpu", "--steps", "3", "--prompts", "4", "--group", "4",
        "--prompt-len", "16", "--max-new-tokens", "16", "--target-mean", "4", "--judge-max-new-tokens", "8",
        "--judge-batch", "8", "--cpu-threads", "1"]


def test_busy_seconds_is_the_union_of_spans_inside_the_window():
    from benchmarks.judge import busy_seconds
    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8), (9.0, 12.0)]
    assert busy_seconds(spans, 1.5, 10.0) == pytest.approx(1.5 + 1.0 + 1.0)
    assert busy_seconds([], 0.0, 1.0) == 0.0
    assert busy_seconds([(2.0, 3.0)], 0.0, 1.0) == 0.0


@pytest.mark.slow  # whole training runs: `pytest -m "not slow"` leaves it out
def test_w4_harness_runs_sync_and_streaming_and_records_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_BENCH_RESULTS", str(tmp_path / "results"))
    from benchmarks import judge as w4
    from benchmarks.rewards import hash_score
    out = tmp_path / "bench"
    assert w4.main([*TINY, "--staleness", "0,1", "--out", str(out)]) == 0
    recs = {k: json.loads((out / f"w4-tiny-conveyor-{k}-seed0.json").read_text()) for k in ("sync", "async-s1")}
    for rec in recs.values():
        assert rec["status"] == "ok", rec["error"]
        assert rec["workload"] == "w4" and rec["device_kind"] == "cpu"
        m = rec["metrics"]
        assert m["steps"] == 3 and m["steady"] and m["window"] == [3, 3] and m["trajectories_recorded"] == 48
        assert m["trained_samples_per_s"] > 0 and m["median_step_s"] > 0
        for key in ("engine_idle_frac", "trainer_idle_frac", "judge_idle_frac"):
            assert 0.0 <= m[key] <= 1.0, key
        # A synchronous step judges its own samples; a streaming one may have judged them all during
        # the step before (its window can then hold no judge call).
        assert m["judge_busy_s"] > 0 if rec["setting"]["max_staleness"] == 0 else m["judge_busy_s"] >= 0
        assert m["judge_tokens_per_s"] > 0
        assert 0 < m["judge_tokens_per_judgement"] <= 8
        assert m["judge_unparseable_frac"] == 1.0  # a random judge writes no score
        assert 1 <= m["reward_batch_mean"] <= 8
        assert rec["config"]["judge"]["device"] == "cpu" and "model_path" not in rec["config"]["judge"]
        # every reward is the hash fallback: W1's hash of the completion under the run's seed
        traces = [json.loads(line) for line in (out / rec["name"] / "traces.jsonl").read_text().splitlines()]
        assert len(traces) == 48
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(out / "model-tiny-seed0")
        for t in traces[:8]:
            text = tok.decode(tok.encode(t["completion"], add_special_tokens=False), skip_special_tokens=True)
            assert t["reward"] == hash_score(text, 0) and t["reward_info"]["reward_error"] == "unparseable"
    assert recs["sync"]["metrics"]["staleness"]["histogram"] == {"0": 48}
    lines = [json.loads(line) for line in (tmp_path / "results" / "w4_cpu.jsonl").read_text().splitlines()]
    assert [r["name"] for r in lines] == ["w4-tiny-conveyor-sync-seed0", "w4-tiny-conveyor-async-s1-seed0"]
    assert all(r["metrics"]["judge_tokens_per_s"] > 0 and "curve" not in r["metrics"] for r in lines)
    table = (out / "table.md").read_text().splitlines()
    assert "judge tok/s" in table[0] and all("| ok |" in line for line in table[2:4])
