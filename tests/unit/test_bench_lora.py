"""benchmarks/lora.py on CPU with a tiny shape: both modes trained, both publish forms timed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two trainers and an engine on a tiny W1 model: over 10 s on a 2-core CPU
def test_lora_benchmark_runs_on_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora.py"), "--model", "tiny", "--prompts", "2",
                          "--group", "2", "--max-new-tokens", "16", "--steps", "1", "--publishes", "2",
                          "--out", str(tmp_path)], check=False, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
                              "CONVEYOR_BENCH_RESULTS": str(tmp_path / "results")})
    assert run.returncode == 0, run.stderr[-2000:]
    rec = json.loads((tmp_path / "lora-tiny.json").read_text())
    (summary,) = [json.loads(x) for x in (tmp_path / "results" / "lora_cpu.jsonl").read_text().splitlines()]
    full, lora = rec["modes"]
    assert (full["mode"], lora["mode"]) == ("full", "lora")
    assert all(m["samples_per_s"] > 0 and m["step_s"] > 0 for m in rec["modes"])
    # Rank 16 on the 7 projections of 2 layers: far fewer trainable numbers and optimizer state.
    assert 0 < lora["trainable_params"] < full["trainable_params"] / 5
    assert 0 < lora["optimizer_state_gib"] < full["optimizer_state_gib"] / 5
    merged, adapter = rec["publish"]["merged"], rec["publish"]["adapter"]
    assert adapter["tensors"] == 2 * 7 * 2 and adapter["bytes_mib"] < merged["bytes_mib"] / 5
    assert all(r["publish_ms"] > 0 and r["apply_ms"] > 0 for r in (merged, adapter))
    assert summary["metrics"]["lora_trainable_params"] == lora["trainable_params"]
    assert summary["metrics"]["publish_adapter_bytes_mib"] == adapter["bytes_mib"]
