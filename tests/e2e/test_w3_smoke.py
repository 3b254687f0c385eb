"""W3 (agentic, multi-turn) end to end on the tiny W1 model: synchronous and streaming, a few steps each.

Checks the shape and sanity of what a W3 row records (no speed assertions: CPU timings on shared
cores mean nothing here), and the environment's own promises: observations that tokenize back to
exactly their ids, seeded latencies, the hash reward at the last turn.
"""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TINY = ["--model", "tiny", "--steps", "3", "--prompts", "4", "--group", "4", "--prompt-len", "16",
        "--max-new-tokens", "16", "--target-mean", "4", "--latency-median-s", "0.05", "--cpu-threads", "1"]


@pytest.fixture(scope="module")
def word_tokenizer_dir(tmp_path_factory):
    from benchmarks.models import build_word_tokenizer
    out = tmp_path_factory.mktemp("w1tok")
    build_word_tokenizer(4096).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("which", ["w1", "tiny"])
def test_observations_tokenize_back_to_exactly_their_ids(which, word_tokenizer_dir):
    from benchmarks import w3_env as E
    from conveyor.types import Task
    spec = word_tokenizer_dir if which == "w1" else "tiny"
    E.check_observation_roundtrip(spec, 32, samples=32)
    tok = E.load_tokenizer(spec)
    env = E.LatencyEnv(median_s=0.0, obs_tokens=32, tokenizer=spec)
    assert env.reset(Task(f"train-{which}", "p")) is None  # the task's prompt is the first observation
    for turn in range(3):
        r = env.step(f"a{turn}")
        assert r.reward == 0.0 and not r.done
        ids = tok(r.observation, add_special_tokens=False)["input_ids"]
        assert len(ids) == 32 and set(ids) <= set(env.ids)
    last = env.step("a3")
    assert last.done and last.observation == ""
    assert last.reward == E.hash_score("a0a1a2a3", 0)  # the hash of the episode's actions


def test_latencies_are_seeded_and_heavy_tailed():
    from benchmarks import w3_env as E
    assert E.latency(0, "train-3", 2, 1, 0.3, E.SIGMA) == E.latency(0, "train-3", 2, 1, 0.3, E.SIGMA)
    assert E.latency(0, "train-3", 2, 1, 0.3, E.SIGMA) != E.latency(0, "train-3", 3, 1, 0.3, E.SIGMA)
    draws = sorted(E.latency(0, f"train-{i}", k, t, 0.3, E.SIGMA) for i in range(100) for k in range(8)
                   for t in range(4))
    p50, p99 = draws[len(draws) // 2], draws[int(0.99 * len(draws))]
    assert 0.27 < p50 < 0.33 and 1.7 < p99 < 2.4


@pytest.mark.slow  # whole training runs: `pytest -m "not slow"` leaves it out
def test_w3_harness_runs_sync_and_streaming_and_records_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_BENCH_RESULTS", str(tmp_path / "results"))
    from benchmarks import w3_agentic
    out = tmp_path / "bench"
    assert w3_agentic.main([*TINY, "--staleness", "0,1", "--out", str(out)]) == 0
    recs = {k: json.loads((out / f"w3-tiny-conveyor-{k}-seed0.json").read_text()) for k in ("sync", "async-s1")}
    for label, rec in recs.items():
        assert rec["status"] == "ok", rec["error"]
        assert rec["workload"] == "w3" and rec["system"] == "conveyor" and rec["device_kind"] == "cpu"
        m = rec["metrics"]
        assert m["steps"] == 3 and m["steady"] and m["window"] == [3, 3]
        assert m["trained_samples_per_s"] > 0 and m["median_step_s"] > 0
        assert 0.0 <= m["engine_idle_frac"] <= 1.0 and 0.0 <= m["trainer_idle_frac"] <= 1.0
        # environment latency: measured by the episodes and drawn by the env
        for key in ("env_step_p50_s", "env_step_p99_s", "env_draw_p50_s", "env_draw_p99_s"):
            assert m[key] > 0, key
        assert m["env_step_p50_s"] <= m["env_step_p99_s"] <= m["env_step_max_s"]
        assert m["env_draw_p50_s"] <= m["env_draw_p99_s"] <= m["env_draw_max_s"] < 120
        assert m["env_steps"] >= 3 * 16 * 4 and m["env_draws"] >= m["env_steps"]
        assert m["turns_mean"] == 4 and m["episodes_finished_frac"] == 1.0 and 0 <= m["reward_mean"] < 1
        # decode time at half the rows or fewer, where the engine counts decode steps by rows
        low = m["engine_lt_half_rows_frac"]
        assert (low is None) == (m["engine_batch_mean"] is None) and (low is None or 0.0 <= low <= 1.0), m
        # per-turn policy lengths (the calibrated tail); whole episodes carry 3 observations of 32 ids
        assert rec["lengths"]["count"] >= 3 * 16 * 4 and 1 <= rec["lengths"]["max"] <= 16
        ep = rec["episode_lengths"]
        assert 4 + 3 * 32 <= ep["p50"] <= ep["max"] <= 4 * 16 + 3 * 32
        assert m["rollout_tokens_per_s"] < m["sequence_tokens_per_s"]  # the policy's tokens only
        assert rec["config"]["env"]["turns"] == 4 and rec["config"]["env"]["obs_tokens"] == 32
    assert recs["sync"]["metrics"]["staleness"]["histogram"] == {"0": 48}
    assert recs["sync"]["metrics"]["staleness"]["multi_version_frac"] == 0.0  # observations carry no version
    assert recs["async-s1"]["setting"]["max_staleness"] == 1 and recs["async-s1"]["setting"]["partial_rollouts"]
    table = (out / "table.md").read_text().splitlines()
    assert table[0].startswith("| system | setting | seed | status |")
    assert all("| ok |" in line for line in table[2:4])
    assert any("async s=1 / sync" in line for line in table)
    # one summary line per configuration, with the environment's latency fields
    lines = [json.loads(l) for l in (tmp_path / "results" / "w3_cpu.jsonl").read_text().splitlines()]
    assert [r["name"] for r in lines] == ["w3-tiny-conveyor-sync-seed0", "w3-tiny-conveyor-async-s1-seed0"]
    for line in lines:
        assert line["workload"] == "w3" and line["metrics"]["trained_samples_per_s"] > 0
        assert line["metrics"]["env_step_p99_s"] > 0 and line["metrics"]["env_draw_p99_s"] > 0
        assert "curve" not in line["metrics"] and line["metrics"]["lengths"]["max"] <= 16
