"""The run directory's JSON files: the metrics history and the final summary.

- ``metrics.jsonl``: one JSON object per line, ``{"step", "kind", "time", **metrics}``, written
  by ``metrics.JsonlSink`` and read back by ``read_metrics``.
- ``write_summary`` / ``read_summary``: ``summary.json``, replaced atomically.
- Everything written goes through ``json_safe``: non-finite numbers become ``null`` (read back
  as ``None``).

It deliberately does not know what the metrics mean or which ones a run
produces; plotting and comparison live with their callers.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def json_safe(value: Any) -> Any:
    """Return ``value`` as plain JSON data: non-finite floats -> None, scalars unwrapped.

    Everything written goes through ``json_safe``: NaN and infinities become
    ``null`` (strict JSON has no spelling for them), numpy/torch scalars become
    Python numbers, tuples become lists, other unknown objects become ``str``.
    Reading therefore returns ``None`` where a non-finite number was written.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    item = getattr(value, "item", None)
    if callable(item):
        # numpy and torch scalars; a multi-element array raises here, which is
        # better than silently writing its repr.
        return json_safe(item())
    return str(value)


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write ``summary`` to ``run_dir/summary.json`` and return that path.

    ``write_summary(run_dir, summary)`` writes ``summary.json`` (indented,
    replaced atomically so a reader never sees half a file); ``read_summary``
    reads it back.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SUMMARY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    # Replace in one step so a crash mid-write leaves the previous summary intact.
    os.replace(tmp, path)
    return path


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """Read ``run_dir/summary.json``."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {SUMMARY_FILE} in {run_dir}; the run has not finished writing one")
    return json.loads(path.read_text(encoding="utf-8"))


def read_metrics(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Parse ``run_dir/metrics.jsonl`` into records, in file order, optionally of one ``kind``.

    A last line without its newline is the mark of a process killed mid-write;
    it is skipped. Any other line that does not parse raises ``ValueError``
    naming the file and line number, because it means the file was damaged.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}; no metrics were logged there")
    text = path.read_text(encoding="utf-8")
    # split() puts "" after a final newline, or the torn tail of a killed
    # writer when that newline is missing; either way the last piece is dropped.
    complete = text.split("\n")[:-1]
    records = []
    for lineno, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        if kind is None or record.get("kind") == kind:
            records.append(record)
    return records
