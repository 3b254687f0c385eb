"""The benchmark harness's pure parts: bounds, length workload, metrics, rewards, tables, deadlines."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import bounds as B  # noqa: E402
from benchmarks import harness as H  # noqa: E402
from benchmarks import lengths as L  # noqa: E402
from benchmarks import metrics as M  # noqa: E402
from benchmarks import rewards as R  # noqa: E402


def test_qwen_shapes_match_published_parameter_counts_and_protocol_bounds():
    s05, s15 = B.SHAPES["qwen2.5-0.5b"], B.SHAPES["qwen2.5-1.5b"]
    assert B.param_count(s05) == 494_032_768
    assert B.param_count(s15) == 1_543_714_304
    assert B.kv_bytes_per_token(s05) == 12_288
    assert B.weight_bytes(s05) == 988_065_536
    # BENCHMARKS.md: ~330k tok/s at B=256, L=512 on 3.35 TB/s; ~270k and ~86k training tokens/s at 800 TFLOP/s
    assert B.decode_bound_tokens_per_s(s05, 256, 512, 3.35e12) == pytest.approx(330_014, rel=1e-5)
    assert B.train_bound_tokens_per_s(s05, 800e12) == pytest.approx(269_888, rel=1e-5)
    assert B.train_bound_tokens_per_s(s15, 800e12) == pytest.approx(86_372, rel=1e-4)
    assert B.train_bound_tokens_per_s(s05, 800e12, recompute=True) == pytest.approx(269_888 * 6 / 8, rel=1e-5)


@pytest.mark.parametrize("name,bw,peak", [
    ("NVIDIA H100 80GB HBM3", 3.35e12, 800e12), ("NVIDIA H100 PCIe", 2.0e12, 800e12),
    ("NVIDIA H200", 4.8e12, 800e12), ("AMD EPYC 7B13 (2 cores visible)", None, None),
])
def test_device_spec_lookup(name, bw, peak):
    spec = B.device_spec(name)
    assert spec == {"bandwidth_bytes_per_s": bw, "peak_flops": peak}
    assert (B.decode_bound_tokens_per_s(B.SHAPES["tiny"], 8, 10, spec["bandwidth_bytes_per_s"]) is None) == (bw is None)


def test_eos_bias_solves_the_mean_stop_probability():
    p0, p = 1e-5, 1 / 256
    # One log-odds value: the bias is exactly the log-odds shift.
    b = L.solve_eos_bias([math.log(p0 / (1 - p0))], p)
    assert b == pytest.approx(math.log(p / (1 - p)) - math.log(p0 / (1 - p0)), abs=1e-9)
    z = [-12.0, -9.0, -11.0]
    b = L.solve_eos_bias(z, p)
    assert sum(1 / (1 + math.exp(-(x + b))) for x in z) / 3 == pytest.approx(p, rel=1e-9)
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        L.solve_eos_bias(z, 1.5)


def test_expected_length_and_length_stats():
    assert L.expected_mean_length(1 / 256, 1024) == pytest.approx(256 * (1 - (255 / 256) ** 1024))
    s = L.length_stats(list(range(1, 101)), cap=100)
    assert (s["p50"], s["p99"], s["max"], s["mean"]) == (50.0, 99.0, 100.0, 50.5)
    assert s["tau"] == pytest.approx(100 / 50.5)
    assert s["truncated_frac"] == pytest.approx(0.01)
    assert L.length_stats([])["tau"] is None


def test_both_systems_get_the_same_bias():
    assert L.conveyor_overrides(6.25) == ["rollout.eos_bias=6.25"]
    assert L.trl_generation_kwargs(6.25, 2) == {"sequence_bias": [[[2], 6.25]]}
    assert L.trl_generation_kwargs(0.0, 2) == {}


def _sync_run(steps=4, sps=4):
    recs = [{"step": k + 1, "kind": "train", "time/step": 2.0, "time/generate": 1.0, "time/prepare": 0.1,
             "time/train": 0.5, "weight_sync_ms": 3.0 + k, "clip_frac": 0.1} for k in range(steps)]
    trajs = [{"split": "train", "prompt_len": 10, "completion_len": 5, "version": k, "versions": 1,
              "finish": "stop", "reward": 0.25 * k} for k in range(steps) for _ in range(sps)]
    return recs, trajs


def test_metrics_of_a_synchronous_run_by_hand():
    steps, trajs = _sync_run()
    m = M.summarize(steps, trajs, samples_per_step=4, cap=8, n_params=1_000_000, peak_flops=1e9,
                    decode_bound=100.0)
    assert m["steady"] and m["window"] == [3, 4]
    assert m["trained_samples_per_s"] == pytest.approx(8 / 4.0)       # 2 steps x 4 samples / 4 s
    assert m["median_step_s"] == 2.0
    assert m["rollout_tokens_per_s"] == pytest.approx(40 / 2.0)       # 8 x 5 completion tokens / 2 s
    assert m["mbu"] == pytest.approx(0.2)
    assert m["training_tokens_per_s"] == pytest.approx(120 / 1.0)     # 8 x (10 + 5) tokens / 1 s
    assert m["mfu"] == pytest.approx(120 * 6e6 / 1e9)
    assert m["engine_idle_frac"] == pytest.approx(0.5)
    assert m["trainer_idle_frac"] == pytest.approx(1 - 1.2 / 4)
    assert m["weight_sync_ms"] == pytest.approx(5.5)
    assert m["staleness"] == {"histogram": {"0": 16}, "multi_version_frac": 0.0}
    assert m["lengths"]["p50"] == 5.0 and m["lengths"]["tau"] == 1.0
    assert [c[2] for c in m["curve"]] == [0.0, 0.25, 0.5, 0.75]


def test_metrics_of_a_loop_whose_engines_report_idle_fractions():
    steps = [{"time/step": 2.0, "time/train": 1.0, "time/prepare": 0.0, "engine0_idle_frac": 0.25,
              "engine1_idle_frac": 0.75, "num_seqs": 4, "staleness_hist/0": 0.75, "staleness_hist/1": 0.25}
             for _ in range(3)]
    trajs = [{"prompt_len": 1, "completion_len": 2, "version": 0, "versions": 2, "reward": 0.0}] * 12
    m = M.summarize(steps, trajs, samples_per_step=4, warmup=1)
    assert m["engines"] == 2
    assert m["engine_idle_frac"] == pytest.approx(0.5)                 # mean of the two engines
    assert m["rollout_tokens_per_s"] == pytest.approx(16 / (2 * 2.0))  # 8 samples x 2 tokens / busy s
    # staleness from the steps' own histograms, not from scoring order
    assert m["staleness"] == {"histogram": {"0": 9, "1": 3}, "multi_version_frac": 1.0}


def test_short_and_empty_runs_do_not_crash():
    steps, trajs = _sync_run(steps=2)
    m = M.summarize(steps, trajs, samples_per_step=4)
    assert not m["steady"] and m["window"] == [1, 2]
    empty = M.summarize([], [], samples_per_step=4)
    assert empty["trained_samples_per_s"] is None and empty["lengths"]["count"] == 0


def test_time_to_threshold_uses_a_running_mean():
    curve = [[i, float(i), r] for i, r in enumerate([0, 0, 1, 1, 1, 1, 1, 1])]
    assert M.time_to_threshold(curve, 0.8, window=5) == 5.0   # steps 1-5: mean 0.8
    assert M.time_to_threshold(curve, 0.81, window=5) == 6.0
    assert M.time_to_threshold(curve, 1.1, window=5) is None
    assert M.mean_decode_context([{"prompt_len": 10, "completion_len": 2}]) == pytest.approx((20 + 3) / 2)


def test_rewards_score_identically_and_record(tmp_path):
    assert R.hash_score("abc", 0) == R.hash_score("abc", 0) != R.hash_score("abc", 1)
    assert 0.0 <= R.hash_score("", 3) < 1.0
    assert R.addition_score("85", "85") == 1.0 and R.addition_score("75", "85") == 0.5
    log = tmp_path / "t.jsonl"
    fn = R.TrlReward("partial_credit", str(log), {2}, lambda p: len(p), seed=0)
    out = fn(prompts=["1+1=", "1+1="], completions=["2", "3"], completion_ids=[[5, 2], [6, 7, 8]],
             answer=["2", "2"], task=["addition", "addition"])
    assert out == [1.0, 0.0]
    rows = [json.loads(l) for l in log.read_text().splitlines()]
    assert [(r["prompt_len"], r["completion_len"], r["finish"]) for r in rows] == [(4, 2, "stop"), (4, 3, "length")]


def test_append_row_writes_the_header_once(tmp_path):
    cols = [("a", lambda r: r["a"]), ("b", lambda r: H.fmt(r["b"]))]
    table = tmp_path / "t.md"
    H.append_row(table, cols, {"a": "x|y", "b": None})
    H.append_row(table, cols, {"a": "z", "b": 0.5})
    assert table.read_text().splitlines() == ["| a | b |", "|---|---|", "| x/y | n/a |", "| z | 0.5 |"]
    assert H.fmt(0.1234, pct=True) == "12.3%" and H.fmt(123456.0) == "123,456"


def test_a_failing_or_hanging_child_becomes_a_status(tmp_path):
    boom = H.run_subprocess([sys.executable, "-c", "raise ValueError('boom')"], tmp_path / "a", deadline_s=60)
    assert boom["status"] == "failed" and boom["rc"] == 1 and boom["error"] == "ValueError: boom"
    hang = H.run_subprocess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "b", deadline_s=1)
    assert hang["status"] == "timeout" and hang["wall_s"] < 30
    missing = H.run_peer({"system": "nosuch", "run_dir": str(tmp_path / "c")}, deadline_s=60)
    assert missing["status"] == "failed" and "nosuch_peer" in missing["error"]


def test_steps_without_an_engine_report_are_covered_by_scaling():
    steps = [{"time/step": 1.0, "time/train": 0.5, "engine0_idle_frac": 0.5, "num_seqs": 2},
             {"time/step": 1.0, "time/train": 0.5, "num_seqs": 2}]
    trajs = [{"prompt_len": 1, "completion_len": 3, "version": 0, "reward": 0.0}] * 4
    m = M.summarize(steps, trajs, samples_per_step=2, warmup=0)
    assert m["engine_report_coverage"] == pytest.approx(0.5)
    assert m["engine_idle_frac"] == pytest.approx(0.5)                 # busy 0.5 s of 1 s, scaled to 1 s of 2 s
    assert m["rollout_tokens_per_s"] == pytest.approx(12 / 1.0)


@pytest.mark.slow  # over 10 s on a 2-core CPU
def test_weight_sync_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/weight_sync_gpu.py over gloo: versions reach both engines and are timed."""
    import os
    import subprocess
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "weight_sync_gpu.py"), "--model", "tiny",
                          "--backend", "gloo", "--engines", "2", "--reps", "3", "--bucket-mb", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
                              "CONVEYOR_BENCH_RESULTS": str(tmp_path / "results")})
    assert run.returncode == 0, run.stderr[-2000:]
    rec = json.loads((tmp_path / "weight-sync-tiny-e2-b1.json").read_text())
    (summary,) = [json.loads(l) for l in (tmp_path / "results" / "weight_sync_cpu.jsonl").read_text().splitlines()]
    assert summary["config"]["engines"] == 2 and summary["metrics"]["publish_ms"] == rec["publish_ms"]
    assert rec["tensors"] > 10 and rec["bytes"] > 0
    assert set(rec["publish_ms"]) == {"float32", "bfloat16", "mixed"}
    assert all(s["median"] > 0 for s in rec["publish_ms"].values())
    # The root's sends end after the publish returns (it only queues them).
    assert all(rec["sent_ms"][k]["median"] >= rec["publish_ms"][k]["median"] for k in rec["publish_ms"])
    assert rec["versions_applied"]["0"] >= 1
    both = {k: {"0", "1"} for k in ("float32", "bfloat16", "mixed")}
    assert {k: set(v) for k, v in rec["applied_ms"].items()} == both
    assert {k: set(v) for k, v in rec["received_ms"].items()} == both
    # An engine holds a version (received) before it has copied it in (applied).
    for k in both:
        for e in ("0", "1"):
            assert 0 < rec["received_ms"][k][e]["median"] <= rec["applied_ms"][k][e]["median"]


def test_append_record_writes_one_summary_line_per_run(tmp_path, monkeypatch):
    """A run appends one line (command, commit, card, date, config, metrics) to its workload's file."""
    monkeypatch.setenv("CONVEYOR_BENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "w1_throughput.py"), "--steps", "5"])
    gpu = H.append_record("w1", {"trained_samples_per_s": 246.0}, config={"seed": 0}, card="NVIDIA H100 80GB HBM3")
    cpu = H.append_record("w1", {"trained_samples_per_s": 30.4}, card=B.cpu_name())
    H.append_record("w1", {"trained_samples_per_s": 31.0}, card=B.cpu_name())
    assert gpu == tmp_path / "w1.jsonl" and cpu == tmp_path / "w1_cpu.jsonl"
    (rec,) = [json.loads(l) for l in gpu.read_text().splitlines()]
    assert set(rec) == {"workload", "date", "commit", "card", "command", "config", "metrics"}
    assert rec["card"] == "NVIDIA H100 80GB HBM3" and rec["metrics"] == {"trained_samples_per_s": 246.0}
    assert rec["command"] == "python benchmarks/w1_throughput.py --steps 5" and rec["date"].endswith("+00:00")
    assert len(cpu.read_text().splitlines()) == 2
