"""benchmarks/recipe_sweep.py: variants x seeds as concurrent runs, one record each, the table of
held-out rewards; a variant whose run fails is recorded as failed, not dropped."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import recipe_sweep  # noqa: E402

TINY = ["sft.steps=0", "loop.steps=2", "loop.eval_every=1", "loop.batch_size=2", "rollout.n=2",
        "data.eval_size=4", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
        "model.tiny.intermediate_size=64", "observe.tensorboard=false", "observe.progress=false"]


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_every_variant_and_seed_runs_and_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_BENCH_RESULTS", str(tmp_path / "results"))
    variants = tmp_path / "variants.txt"
    variants.write_text("# the recipe, a change, and a mistake\nbase|\nhot|rollout.temperature=1.5\n"
                        "broken|trainer.lr=-1\n")
    rc = recipe_sweep.main(["-", "--variants", str(variants), "--seeds", "0,1", "--concurrency", "3",
                            "--out", str(tmp_path / "out"), *[f"--override={o}" for o in TINY]])
    assert rc == 1  # the broken variant's runs failed
    records = [json.loads(l) for l in (tmp_path / "results" / "recipe_sweep_cpu.jsonl").read_text().splitlines()]
    assert sorted(r["name"] for r in records) == ["base-s0", "base-s1", "broken-s0", "broken-s1", "hot-s0", "hot-s1"]
    for r in records:
        ok = r["config"]["variant"] != "broken"
        assert r["metrics"]["status"] == ("ok" if ok else "exit 2"), r
        if ok:
            assert set(r["metrics"]["held_out"]) == {"0", "1", "2"} and r["metrics"]["steps"] == 2, r
            assert r["metrics"]["trained_samples"] == 8
            assert all(0.0 <= v <= 1.0 for v in r["metrics"]["held_out"].values())
    hot = next(r for r in records if r["name"] == "hot-s1")
    assert hot["config"]["overrides"][-1] == "rollout.temperature=1.5" and hot["config"]["seed"] == 1
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| broken | exit 2 | exit 2 |  |" in table and "(step 2)" in table


def test_a_variant_value_with_spaces_is_quoted_and_an_open_quote_is_named(tmp_path):
    path = tmp_path / "variants.txt"
    path.write_text('calc|"data.system_prompt=You are a calculator." data.options.digits=2  # comment\nplain|\n')
    assert recipe_sweep.read_variants(path) == [
        ("calc", ["data.system_prompt=You are a calculator.", "data.options.digits=2"]), ("plain", [])]
    path.write_text('bad|"data.system_prompt=You are\n')
    with pytest.raises(SystemExit, match=r"variants.txt:1: No closing quotation .*close the quote"):
        recipe_sweep.read_variants(path)
