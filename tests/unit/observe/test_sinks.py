"""observe.sinks: W&B (offline, read back from its run file) and MLflow (a file store, read back
with MlflowClient) get the metrics, the resolved config and the final summary; an unknown name or
a contradiction is a config error, and a missing package is one line naming the extra."""
from __future__ import annotations

import glob
import json
import struct
import sys
import time
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.config import ConfigError, ObserveConfig, load_config
from conveyor.observe.metrics import MetricsLogger, MissingPackage, SinkError

CONFIG = load_config(None, ["loop.steps=3", "rollout.n=4"]).model_dump(mode="json")
SUMMARY = {"steps": 3, "eval_reward_final": 0.75, "final_metrics": {"reward": 0.5}, "run_dir": "/somewhere"}


def log_a_run(run_dir, sinks) -> None:
    with MetricsLogger(run_dir, progress=False, tensorboard=False, sinks=sinks, config=CONFIG) as log:
        for step, reward in ((1, 0.25), (2, 0.5), (3, 0.625)):
            log.log(step, {"reward": reward, "loss": -0.1 * step})
        log.log(3, {"eval_reward": 0.75}, kind="eval")
        log.summary(SUMMARY)


def wandb_records(path) -> list:
    """The records of a W&B run file (``run-*.wandb``), parsed with W&B's own protobuf types. The file
    is W&B's append-only log: a 7-byte header, then 32 KiB blocks of records, each a 7-byte header
    (crc, length, type: full / first / middle / last) and its bytes, split over blocks when long."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts, records = 7, 32768, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left for a header: the block is padded
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(b"".join(parts))
            records.append(rec)
            parts = []
    return records


def wandb_written(run_dir: Path, deadline_s: float = 60.0) -> list:
    """The records of the run's one offline W&B file once its run and summary records are in it:
    W&B's service writes the file beside the process, so ``finish()`` may return before the file
    is whole (seen once in a loaded test session). Whatever is there at the deadline otherwise."""
    end = time.monotonic() + deadline_s
    while True:
        paths = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(paths) <= 1, paths
        try:
            records = wandb_records(paths[0]) if paths else []
        except Exception:  # noqa: BLE001 - a record half written; read again, or raise at the deadline
            if time.monotonic() > end:
                raise
            records = []
        if {"run", "summary"} <= {r.WhichOneof("record_type") for r in records} or time.monotonic() > end:
            return records
        time.sleep(0.2)


def test_wandb_offline_run_holds_metrics_config_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    log_a_run(tmp_path / "run", ["wandb"])
    records = wandb_written(tmp_path / "run")
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "conveyor" and run.display_name == "run"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["loop"]["steps"] == 3 and config["rollout"]["n"] == 4
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            history.append(items)
    assert [(h["_step"], h["train/reward"]) for h in history if "train/reward" in h] == [
        (1, 0.25), (2, 0.5), (3, 0.625)]
    assert [h["eval/reward"] for h in history if "eval/reward" in h] == [0.75]
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in r.summary.update})
    assert summary["eval_reward_final"] == 0.75 and summary["final_metrics.reward"] == 0.5
    assert summary["run_dir"] == "/somewhere"


def test_mlflow_file_store_holds_metrics_params_and_summary(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks to opt in to file stores
    log_a_run(tmp_path / "run", ["mlflow"])
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("conveyor").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["loop.steps"] == "3" and run.data.params["rollout.n"] == "4"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/reward")] == [
        (1, 0.25), (2, 0.5), (3, 0.625)]
    assert run.data.metrics["eval/reward"] == 0.75
    assert run.data.metrics["summary/eval_reward_final"] == 0.75
    assert run.data.metrics["summary/final_metrics.reward"] == 0.5
    assert run.data.tags["summary.run_dir"] == "/somewhere"


def test_an_unusable_mlflow_store_is_one_line_naming_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://x")
    with pytest.raises(SinkError, match="MLFLOW_TRACKING_URI") as e:
        log_a_run(tmp_path / "run", ["mlflow"])
    assert "\n" not in str(e.value)


def test_sink_names_are_checked_when_the_config_loads():
    assert load_config(None, ["observe.sinks=[wandb,mlflow]"]).observe.sinks == ["wandb", "mlflow"]
    with pytest.raises(ConfigError, match=r"unknown sink 'wandbb' \(did you mean 'wandb'\?\)"):
        load_config(None, ["observe.sinks=[wandbb]"])
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(None, ["observe.sinks=[mlflow,mlflow]"])
    with pytest.raises(ConfigError, match="lists tensorboard but observe.tensorboard is false"):
        load_config(None, ["observe.sinks=[tensorboard]", "observe.tensorboard=false"])


def test_tensorboard_by_name_and_the_sink_fields_are_logger_keywords(tmp_path):
    cfg = ObserveConfig(progress=False, tensorboard=False, timeline=False)
    fields = cfg.model_dump(include={"progress", "tensorboard", "sinks", "project", "timeline"})
    with MetricsLogger(tmp_path / "a", **fields, total_steps=3) as log:
        log.log(1, {"reward": 0.5})
    assert [type(s).__name__ for s in log.sinks] == ["JsonlSink"]
    with MetricsLogger(tmp_path / "b", progress=False, tensorboard=False, sinks=["tensorboard"]) as log:
        log.log(1, {"reward": 0.5})
    assert [type(s).__name__ for s in log.sinks] == ["JsonlSink", "TensorBoardSink"]


def test_a_missing_package_stops_before_any_file_and_the_cli_says_it_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes the import fail
    with pytest.raises(MissingPackage, match=r"observe.sinks: wandb needs the `wandb` package.*conveyor\[tracking\]"):
        MetricsLogger(tmp_path / "run", progress=False, sinks=["wandb"])
    assert not (tmp_path / "run").exists()
    fast = ["sft.steps=0", "loop.steps=1", "loop.batch_size=2", "rollout.n=2", "data.eval_size=2",
            "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
            "observe.progress=false", "observe.sinks=[wandb]", f"--output-dir={tmp_path / 'cli'}"]
    assert main(["train", *fast]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("conveyor: error:")]
    assert len(err) == 1 and "pip install 'conveyor[tracking]'" in err[0]
