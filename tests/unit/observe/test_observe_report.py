"""Run files: summary.json round trip, metrics.jsonl parsing and its damage rules."""
import json

import pytest

from conveyor.observe.report import json_safe, read_metrics, read_summary, write_summary


def test_summary_round_trip_with_non_finite(tmp_path):
    summary = {"final_eval_reward": 0.75, "steps": 20, "loss": float("nan"),
               "best": {"step": 12, "kl": float("inf")}, "history": (1.0, float("-inf")),
               "run_dir": tmp_path}
    path = write_summary(tmp_path, summary)
    assert path == tmp_path / "summary.json"
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert text.startswith("{\n  ")  # indented for people
    assert read_summary(tmp_path) == {"final_eval_reward": 0.75, "steps": 20, "loss": None,
                                      "best": {"step": 12, "kl": None}, "history": [1.0, None],
                                      "run_dir": str(tmp_path)}
    assert not (tmp_path / "summary.json.tmp").exists()


def test_json_safe_unwraps_tensor_scalars():
    import torch
    assert json_safe({"a": torch.tensor(2.5), "b": torch.tensor(float("nan")), "c": True}) == {
        "a": 2.5, "b": None, "c": True}


def test_read_metrics_filters_kind_and_skips_torn_tail(tmp_path):
    lines = [{"step": 1, "kind": "train", "time": 1.0, "reward": 0.5},
             {"step": 1, "kind": "eval", "time": 2.0, "reward": 0.25},
             {"step": 2, "kind": "train", "time": 3.0, "reward": None}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "ki')
    assert read_metrics(tmp_path) == lines
    assert [r["step"] for r in read_metrics(tmp_path, kind="train")] == [1, 2]
    assert read_metrics(tmp_path, kind="eval")[0]["reward"] == 0.25


def test_read_metrics_damaged_middle_line_names_location(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        read_metrics(tmp_path)


def test_missing_files_raise_with_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="summary.json"):
        read_summary(tmp_path)
