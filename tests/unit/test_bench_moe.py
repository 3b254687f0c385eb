"""benchmarks/moe_mismatch.py on CPU with the tiny shape: one record, and at float32 replay matches."""
import json
import os

import pytest

from benchmarks import moe_mismatch


@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
def test_moe_mismatch_runs_on_cpu(tmp_path, monkeypatch, engine_dtype):
    monkeypatch.setitem(os.environ, "CONVEYOR_BENCH_RESULTS", str(tmp_path))
    assert moe_mismatch.main(["--shape", "tiny", "--layers", "2", "--prompts", "2", "--n", "2", "--new", "6",
                              "--prompt-len", "6", "--engine-dtype", engine_dtype]) == 0
    (rec,) = [json.loads(x) for x in (tmp_path / "moe_mismatch_cpu.jsonl").read_text().splitlines()]
    m = rec["metrics"]
    assert rec["config"]["engine_dtype"] == engine_dtype and rec["config"]["layers"] == 2
    assert m["sequences"] == 4 and 4 <= m["completion_tokens"] <= 24
    assert len(m["routing_differs_per_layer"]) == 2
    assert 0.0 <= m["routing_differs_per_layer_mean"] <= m["routing_differs_any_layer"] <= 1.0
    for key in ("ratio", "ratio_replay"):
        assert 0 < m[key]["p1"] <= m[key]["p50"] <= m[key]["p99"]
    if engine_dtype == "float32":
        # the same numbers on both sides up to summation order: replayed logprobs agree to float32 rounding
        assert m["logprob_absdiff_max_replay"] < 1e-4
    else:
        # bf16 keeps about 3 significant digits: logprobs of magnitude ~5 differ by up to a few 1e-2
        assert 0 < m["logprob_absdiff_max_replay"] < 0.1
