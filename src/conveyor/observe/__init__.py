"""Observing a run: phase timers, metrics sinks (JSONL, TensorBoard, console, trackers), run files.

Contract: the names below are the package's public surface. Importing it
costs only tqdm; TensorBoard, W&B and MLflow are imported when their sink is
built. It deliberately does not know the RL loop: callers pass numbers in.
"""
from conveyor.observe.metrics import (
    DEFAULT_KEYS,
    JsonlSink,
    MetricsLogger,
    MlflowSink,
    ProgressSink,
    Sink,
    TensorBoardSink,
    WandbSink,
)
from conveyor.observe.report import read_metrics, read_summary, write_summary
from conveyor.observe.timers import PhaseTimer

__all__ = [
    "DEFAULT_KEYS", "JsonlSink", "MetricsLogger", "MlflowSink", "PhaseTimer", "ProgressSink", "Sink",
    "TensorBoardSink", "WandbSink", "read_metrics", "read_summary", "write_summary",
]
