"""Metrics fan-out: one ``log`` call reaches every sink (JSONL, TensorBoard, console, trackers).

Contract: ``MetricsLogger(run_dir, ...).log(step, metrics, kind)`` validates
the metrics once and hands the same dict to every sink in order (``Sink``:
``log(step, metrics, kind)`` and ``close()``). Built in: ``JsonlSink``
(``metrics.jsonl``, the source of truth, flushed per line), ``TensorBoardSink``,
``ProgressSink`` (the console, stderr), ``WandbSink``, ``MlflowSink``; the names
of ``observe.sinks`` build the trackers, which get the run's ``config`` and
``summary(...)``. A tracker whose package is missing is a one-line
``MissingPackage`` naming the extra, raised before any file opens; one that
cannot start a one-line ``SinkError`` saying what to set. Shared stores name a
metric ``<kind>/<key>`` (``qualified``). ``timeline=True`` records
``timeline.json`` while open. ``log_every`` thins only the console. A failing
sink raises; ``close()`` closes every sink, then re-raises.

It does not know which metrics a run produces, how steps are numbered, or what
a run directory holds beyond its own files.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import math
import operator
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, TextIO, runtime_checkable

from tqdm import tqdm

from conveyor.observe import timeline as timeline_mod
from conveyor.observe.report import METRICS_FILE, json_safe

TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = frozenset({"step", "kind", "time"})
# What the console shows by default: train keys bare, other kinds as kind/key.
DEFAULT_KEYS: tuple[str, ...] = ("reward", "eval/reward", "loss", "kl", "samples_per_s", "time/step")
TRACKING_EXTRA = "conveyor[tracking]"

Number = float | int


@runtime_checkable
class Sink(Protocol):
    """Receives every logged step; ``metrics`` is already validated and must not be mutated."""

    def log(self, step: int, metrics: Mapping[str, Number], kind: str = "train") -> None: ...

    def close(self) -> None: ...


def qualified(kind: str, key: str) -> str:
    """The name a metric gets in stores shared across kinds: ``eval/reward``.

    A key that already spells its kind as a prefix (``eval_reward`` logged as
    eval) is not prefixed twice: it becomes ``eval/reward``, not
    ``eval/eval_reward``.
    """
    for sep in ("_", "/"):
        if key.startswith(kind + sep) and len(key) > len(kind) + 1:
            key = key[len(kind) + 1:]
            break
    return f"{kind}/{key}"


def format_value(key: str, value: Number) -> str:
    """Render one number in at most about 7 characters; ``time/*`` keys get an ``s`` suffix."""
    if isinstance(value, bool) or isinstance(value, int):
        text = str(int(value))
    elif not math.isfinite(value):
        text = str(value)
    else:
        a = abs(value)
        if a == 0:
            text = "0"
        elif a >= 1e5 or a < 1e-2:
            mantissa, exp = f"{value:.1e}".split("e")
            text = f"{mantissa}e{int(exp)}"
        elif a >= 100:
            text = f"{value:.0f}"
        else:
            text = f"{value:.3g}"
    return text + ("s" if key.startswith("time/") else "")


def _clean_metrics(metrics: Mapping[str, Any]) -> dict[str, Number]:
    out: dict[str, Number] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric names must be non-empty strings, got {key!r}")
        if key in RESERVED_KEYS:
            raise ValueError(f"metric name {key!r} is reserved for the record itself; rename it")
        item = getattr(value, "item", None)
        if callable(item) and not isinstance(value, (int, float)):
            value = item()  # numpy / torch scalar; a multi-element tensor raises here
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)):
            raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")
        out[key] = value
    return out


class JsonlSink:
    """Appends one JSON object per step to a file, flushed per line so a crash keeps the history."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        # Append, so a resumed run continues the same history.
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, Number], kind: str = "train") -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path} is closed")
        record = {"step": step, "kind": kind, "time": time.time(), **metrics}
        self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line left without its newline by a killed writer, so appends stay parseable."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Scan back in blocks for the last newline; lines are short, so this is one block.
        pos = size
        while pos > 0:
            start = max(0, pos - 4096)
            f.seek(start)
            block = f.read(pos - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                f.truncate(start + nl + 1)
                return
            pos = start
        f.truncate(0)


_warned: set[str] = set()


def _warn_once(tag: str, text: str) -> None:
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


class TensorBoardSink:
    """Scalars as TensorBoard event files, tagged ``<kind>/<key>``.

    If TensorBoard is not importable it warns once and does nothing, because
    the JSONL file already keeps every number and a missing viewer is no
    reason to stop a run.
    """

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        try:
            # Imported here: it pulls in tensorboard and protobuf, which runs
            # that log nowhere should not pay for.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            _warn_once("tensorboard", f"TensorBoard logging is off: {e}. "
                       f"Install `tensorboard` to get event files; metrics.jsonl is still written.")
            return
        # purge_step: a resumed run's events of later steps are hidden, its new ones take their place.
        self._writer = SummaryWriter(log_dir=str(self.log_dir),
                                     purge_step=None if purge_step is None else purge_step + 1)

    @property
    def available(self) -> bool:
        return self._writer is not None

    def log(self, step: int, metrics: Mapping[str, Number], kind: str = "train") -> None:
        if self._writer is None:
            return
        now = time.time()
        for key, value in metrics.items():
            self._writer.add_scalar(qualified(kind, key), value, global_step=step, walltime=now)
        # Per step rather than every 2 minutes (the writer's default), so a
        # crashed or live run shows its latest step; steps take seconds anyway.
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _isatty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # closed or detached stream
        return False


class ProgressSink:
    """The console: a tqdm bar on a terminal, plain summary lines elsewhere.

    Every human-readable line (bar, plain lines, ``message``) goes to one stream, stderr by
    default, so stdout stays free for a command's machine-readable result and ``2>file`` holds
    the whole story. Off a terminal (CI, redirected logs) one plain line is printed per
    ``log_every`` train steps and for every non-train log. The bar shows the largest train step
    seen.
    ``keys`` picks what the bar's postfix and the plain train lines show: a
    bare key names a train metric, ``<kind>/<key>`` one of another kind (the
    latest value is kept, so ``eval/reward`` stays visible between evals).
    """

    def __init__(self, total_steps: int | None = None, keys: Sequence[str] = DEFAULT_KEYS,
                 log_every: int = 1, stream: TextIO | None = None, tty: bool | None = None) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.total_steps = total_steps
        self.keys = tuple(keys)
        self.log_every = log_every
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self._latest: dict[str, Number] = {}
        self._bar: tqdm | None = None
        self._started = time.monotonic()
        self._train_logs = 0

    def log(self, step: int, metrics: Mapping[str, Number], kind: str = "train") -> None:
        for key, value in metrics.items():
            self._latest[key if kind == "train" else qualified(kind, key)] = value
        if kind == "train":
            self._train_logs += 1
        if self.tty:
            self._update_bar(step, metrics, kind)
        elif self._due(step, kind):
            print(self.line(step, metrics, kind), file=self.stream, flush=True)

    def _due(self, step: int, kind: str) -> bool:
        if kind != "train":
            return True  # evals are rare and are what people scroll for
        return (self._train_logs == 1 or step % self.log_every == 0
                or (self.total_steps is not None and step >= self.total_steps))

    def _update_bar(self, step: int, metrics: Mapping[str, Number], kind: str) -> None:
        if self._bar is None:
            # Created at the first log, not in __init__, so model loading
            # output printed before training does not tangle with the bar.
            # A resumed run starts the bar where it left off.
            self._bar = tqdm(total=self.total_steps, initial=max(step - 1, 0) if kind == "train" else 0,
                             file=self.stream, unit="step", dynamic_ncols=True, desc="train")
        self._bar.set_postfix_str(self.postfix(), refresh=False)
        if kind != "train":
            self._bar.write(self.line(step, metrics, kind), file=self.stream)
        if kind == "train" and step > self._bar.n:
            self._bar.update(step - self._bar.n)
        else:
            self._bar.refresh()

    def postfix(self) -> str:
        """The latest values of ``keys``, e.g. ``reward=0.512 loss=-0.0123 time/step=1.9s``."""
        return " ".join(f"{k}={format_value(k, self._latest[k])}" for k in self.keys if k in self._latest)

    def line(self, step: int, metrics: Mapping[str, Number], kind: str = "train") -> str:
        """One plain summary line: where the run is, then the numbers that matter."""
        # Other kinds (e.g. a warm-start phase) count their own steps, so the
        # RL total would mislead there.
        counts_rl_steps = kind in ("train", "eval")
        total = f"/{self.total_steps}" if self.total_steps is not None and counts_rl_steps else ""
        elapsed = tqdm.format_interval(time.monotonic() - self._started)
        if kind == "train":
            body = self.postfix()
            if not body:
                # None of the chosen keys were logged: show the first few of what was.
                body = " ".join(f"{k}={format_value(k, v)}" for k, v in list(metrics.items())[:6])
        else:
            body = " ".join(f"{k}={format_value(k, v)}" for k, v in metrics.items())
        return f"[{kind}] step {step}{total} {elapsed} | {body}"

    def phase(self, name: str, total: int) -> contextlib.AbstractContextManager:
        """No bar for short phases here; ``.update()`` on what it yields does nothing."""
        return _no_bar()

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)  # clears and redraws the bar around the text
            self.stream.flush()
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _no_bar() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext(SimpleNamespace(update=lambda n=1: None))


class MissingPackage(ImportError):
    """A metrics sink was asked for whose package is not installed; the message names the extra."""


class SinkError(RuntimeError):
    """A metrics sink that cannot start (not logged in, no tracking store); the message says what to set."""


# observe.sinks name -> the module its sink imports
TRACKER_MODULES = {"wandb": "wandb", "mlflow": "mlflow"}


def _require(module: str, sink: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingPackage(f"{sink} needs the `{module}` package, which is not installed; "
                             f"install it with: pip install '{TRACKING_EXTRA}'") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class WandbSink:
    """Weights & Biases: one W&B run; metrics logged as ``<kind>/<key>`` at ``step``.

    W&B ignores a step lower than one already logged, so steps must not go
    backwards (train and eval at the same step are fine).
    """

    def __init__(self, project: str = "conveyor", *, name: str | None = None,
                 run_dir: str | Path | None = None, config: Mapping[str, Any] | None = None,
                 **init_kwargs: Any) -> None:
        wandb = _require("wandb", "WandbSink")
        try:
            self._run = wandb.init(project=project, name=name, dir=str(run_dir) if run_dir else None,
                                   config=dict(config) if config else None, **init_kwargs)
        except Exception as e:  # noqa: BLE001 - W&B's own errors (login, network) vary by version
            raise SinkError(f"W&B could not start a run: {_first_line(e)}; log in with `wandb login` "
                            "(or set WANDB_API_KEY), or set WANDB_MODE=offline to write the run locally") from e

    def log(self, step: int, metrics: Mapping[str, Number], kind: str = "train") -> None:
        self._run.log({qualified(kind, k): v for k, v in metrics.items()}, step=step)

    def summary(self, summary: Mapping[str, Any]) -> None:
        """The run's final numbers as the W&B run's summary (nested keys joined by dots)."""
        self._run.summary.update(_flatten(json_safe(summary)))

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MlflowSink:
    """MLflow: one run in ``experiment``; metrics logged as ``<kind>/<key>`` at ``step``.

    Uses ``MlflowClient`` rather than the module-level active run, so it
    neither needs nor disturbs a run the caller may have started.
    """

    def __init__(self, experiment: str = "conveyor", *, run_name: str | None = None,
                 tracking_uri: str | None = None, params: Mapping[str, Any] | None = None) -> None:
        mlflow = _require("mlflow", "MlflowSink")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric_cls, self._tag_cls = Metric, RunTag
        try:
            self._client = MlflowClient(tracking_uri=tracking_uri)
            found = self._client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
            self._run_id: str | None = self._client.create_run(exp_id, run_name=run_name).info.run_id
        except Exception as e:  # noqa: BLE001 - any store error means the same: fix the tracking URI
            uri = tracking_uri or mlflow.get_tracking_uri()
            raise SinkError(f"MLflow cannot use the tracking store {uri!r}: {_first_line(e)}; set "
                            "MLFLOW_TRACKING_URI to a tracking server (http://host:5000), or to file:DIR "
                            "with MLFLOW_ALLOW_FILE_STORE=true") from e
        flat = [Param(k, str(v)[:500]) for k, v in _flatten(params or {}).items()]
        for i in range(0, len(flat), 100):  # MLflow caps a batch at 100 params
            self._client.log_batch(self._run_id, params=flat[i:i + 100])

    def log(self, step: int, metrics: Mapping[str, Number], kind: str = "train") -> None:
        if self._run_id is None:
            raise RuntimeError("MlflowSink is closed")
        ms = int(time.time() * 1000)
        batch = [self._metric_cls(qualified(kind, k), float(v), ms, step) for k, v in metrics.items()]
        self._client.log_batch(self._run_id, metrics=batch)

    def summary(self, summary: Mapping[str, Any]) -> None:
        """The run's final numbers as metrics ``summary/<key>`` (nested keys joined by dots, at the
        run's last step), its words (paths, names) as tags ``summary.<key>``."""
        if self._run_id is None:
            raise RuntimeError("MlflowSink is closed")
        flat = _flatten(json_safe(summary))
        step = flat.get("steps") if isinstance(flat.get("steps"), int) else 0
        ms = int(time.time() * 1000)
        numbers = [self._metric_cls(f"summary/{k}", float(v), ms, step) for k, v in flat.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        words = [self._tag_cls(f"summary.{k}", str(v)[:5000]) for k, v in flat.items() if isinstance(v, str)]
        for i in range(0, len(numbers), 1000):  # MLflow caps a batch at 1000 metrics
            self._client.log_batch(self._run_id, metrics=numbers[i:i + 1000])
        if words:
            self._client.log_batch(self._run_id, tags=words[:100])

    def close(self) -> None:
        if self._run_id is not None:
            self._client.set_terminated(self._run_id)
            self._run_id = None


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _check_sink_names(names: Sequence[str]) -> None:
    for name in names:
        if name in TRACKER_MODULES:
            _require(TRACKER_MODULES[name], f"observe.sinks: {name}")
        elif name != "tensorboard":
            raise ValueError(f"unknown sink {name!r}; choose from tensorboard, {', '.join(TRACKER_MODULES)}")


def _trackers(names: Sequence[str], project: str, run_dir: Path,
              config: Mapping[str, Any] | None) -> list[WandbSink | MlflowSink]:
    """The W&B and MLflow sinks ``names`` asks for, each a run named after the run directory and
    given ``config``; if one cannot start, those already started are closed."""
    out: list[WandbSink | MlflowSink] = []
    try:
        for name in names:
            if name == "wandb":
                out.append(WandbSink(project, name=run_dir.name, run_dir=run_dir, config=config))
            elif name == "mlflow":
                out.append(MlflowSink(project, run_name=run_dir.name, params=config))
    except BaseException:
        for sink in out:
            with contextlib.suppress(Exception):
                sink.close()
        raise
    return out


class MetricsLogger:
    """Fans each ``log`` out to JSONL, TensorBoard, the console and any extra sinks.

    The keyword names match ``ObserveConfig``, so
    ``MetricsLogger(run_dir, **cfg.observe.model_dump(), total_steps=cfg.loop.steps)``
    wires it from a run config. ``sinks`` holds sink objects and names of
    ``observe.sinks``; ``config`` is what the named trackers record as the run's
    parameters (the resolved config). ``log`` unwraps numpy / torch scalars, refuses other
    values and non-string keys, and hands one dict to every sink in order; the JSONL line keeps
    the keys exactly as logged, beside its ``kind``.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, progress: bool = True,
                 total_steps: int | None = None, keys: Sequence[str] = DEFAULT_KEYS,
                 log_every: int = 1, sinks: Sequence[Sink | str] = (), stream: TextIO | None = None,
                 console: Any = None, traces_per_step: int = 0, traces_max_mb: float = 64.0,
                 tokenizer: Any = None, seed: int = 0, project: str = "conveyor", timeline: bool = False,
                 config: Mapping[str, Any] | None = None, eval_samples: int = 0,
                 purge_step: int | None = None) -> None:
        names = [s for s in sinks if isinstance(s, str)]
        _check_sink_names(names)  # before any file is opened, so a missing package leaves nothing behind
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._stream = stream
        self.sinks: list[Sink] = [JsonlSink(self.run_dir / METRICS_FILE)]
        if tensorboard or "tensorboard" in names:
            self.sinks.append(TensorBoardSink(self.run_dir / TENSORBOARD_DIR, purge_step))
        try:
            self.trackers = _trackers(names, project, self.run_dir, config)
        except BaseException:
            for sink in self.sinks:  # the metrics file and event files opened above
                sink.close()
            raise
        # ``console``: a sink with ``message`` and ``phase`` (observe.progress.PhaseProgress)
        # that replaces the plain bar.
        self.progress: Any = None
        if progress:
            self.progress = console or ProgressSink(total_steps, keys, max(log_every, 1), stream=stream)
            self.sinks.append(self.progress)
        self.sinks.extend(self.trackers)
        self.sinks.extend(s for s in sinks if not isinstance(s, str))
        # Sampled trajectories per step (observe.traces): needs the tokenizer for their text.
        self.tracer = None
        if traces_per_step and tokenizer is not None:
            from conveyor.observe.traces import TraceWriter
            self.tracer = TraceWriter(self.run_dir, tokenizer, traces_per_step, traces_max_mb, seed)
        # The first held-out tasks' completions at every evaluation (observe.eval_samples).
        self.eval_tracer = None
        if eval_samples and tokenizer is not None:
            from conveyor.observe.traces import EVAL_SAMPLES_FILE, TraceWriter
            self.eval_tracer = TraceWriter(self.run_dir, tokenizer, eval_samples, traces_max_mb, name=EVAL_SAMPLES_FILE)
        # The role timeline (observe.timeline): active for this process while the logger is open.
        self.timeline = timeline_mod.Timeline(self.run_dir) if timeline else None
        if self.timeline is not None:
            timeline_mod.activate(self.timeline)
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any], kind: str = "train") -> None:
        """Record ``metrics`` for ``step``; ``kind`` is ``"train"`` or ``"eval"`` (any word works)."""
        if self._closed:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
        step = operator.index(step)
        if not kind or "/" in kind:
            raise ValueError(f"kind must be a plain word such as 'train' or 'eval', got {kind!r}")
        clean = _clean_metrics(metrics)
        for sink in self.sinks:
            sink.log(step, clean, kind)

    def eval_samples(self, step: int, trajectories: Sequence[Any], kind: str) -> None:
        """Write the first ``observe.eval_samples`` of an evaluation's trajectories (held-out tasks
        in their fixed order), each marked with ``kind`` ("eval", "eval_sampled")."""
        if self.eval_tracer is not None:
            self.eval_tracer.write_trajectories(step, list(trajectories[:self.eval_tracer.per_step]), eval=kind)

    def trace(self, step: int, groups: Sequence[Any], places: tuple[int, ...] = ()) -> None:
        """Write ``step``'s sampled trajectories, with their groups' places in the rollout schedule
        when given (a no-op without traces or a tokenizer)."""
        if self.tracer is not None:
            self.tracer.write(step, list(groups), places)

    def summary(self, summary: Mapping[str, Any]) -> None:
        """Hand the run's final summary to the trackers named in ``sinks`` (W&B, MLflow)."""
        for tracker in self.trackers:
            tracker.summary(summary)

    def message(self, text: str) -> None:
        """Print a line for people, above the progress bar when there is one."""
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, file=self._stream if self._stream is not None else sys.stderr, flush=True)

    def phase(self, name: str, total: int) -> contextlib.AbstractContextManager:
        """A short phase's bar (``.update()`` advances it), where the console draws one."""
        if self.progress is None:
            return _no_bar()
        return self.progress.phase(name, total)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        first_error: BaseException | None = None
        if self.timeline is not None:
            timeline_mod.deactivate(self.timeline)
            try:
                self.timeline.close()
            except Exception as e:  # noqa: BLE001 - the sinks below still close
                first_error = e
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # close the rest before reporting
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
