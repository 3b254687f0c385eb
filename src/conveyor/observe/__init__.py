"""Observing a run: phase timers, metrics sinks (JSONL, TensorBoard, console, trackers), run files,
the role timeline (``timeline``) and the HTML report (``html_report``).

Contract: the names below are the package's public surface. Importing it
costs only tqdm; TensorBoard, W&B and MLflow are imported when their sink is
built. It deliberately does not know the RL loop: callers pass numbers in.
"""
from conveyor.observe.metrics import (
    DEFAULT_KEYS,
    JsonlSink,
    MetricsLogger,
    MissingPackage,
    MlflowSink,
    ProgressSink,
    Sink,
    SinkError,
    TensorBoardSink,
    WandbSink,
)
from conveyor.observe.report import read_metrics, read_summary, write_summary
from conveyor.observe.timers import PhaseTimer

__all__ = [
    "DEFAULT_KEYS", "JsonlSink", "MetricsLogger", "MissingPackage", "MlflowSink", "PhaseTimer", "ProgressSink",
    "Sink", "SinkError", "TensorBoardSink", "WandbSink", "read_metrics", "read_summary", "write_summary",
]
