"""What a person reads on the console: one bar per phase, eval lines, the final summary.

- ``PhaseProgress`` is the console sink of ``MetricsLogger`` for a run: one bar per phase on a
  terminal, a compact line every few steps otherwise; every number still reaches metrics.jsonl.
- ``quiet_libraries()`` switches off other libraries' progress bars and info logs, in this
  process and in the role processes it starts.
- ``summary_text(summary, run_dir, examples)`` renders the end of a run.

It knows the names of the metrics it shows and the run directory's layout; it
does not know how they are computed.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from conveyor.observe.metrics import format_value

# Shown per phase: (metric key as logged, label).
RL_KEYS = (("reward", "reward"), ("loss", "loss"), ("samples_per_s", "samples/s"))
SFT_KEYS = (("sft_loss", "loss"), ("sft_check_reward", "check"))
LINES_PER_PHASE = 20
LENGTH_FIX = ("shorten the prompts (data.prompt_template, data.system_prompt, or the data itself) or use a model "
              "with a longer context (model.path, model.tiny.max_position_embeddings)")


def say(text: str, stream: TextIO | None = None) -> None:
    print(text, file=stream or sys.stderr, flush=True)


def quiet_libraries() -> None:
    """No library progress bars or info chatter on the console (in child processes too).

    ``quiet_libraries()`` switches off other libraries' progress bars and info
    logs (Hugging Face "Loading weights" bars, transformers' advisories), in this
    process and, through the environment, in the role processes it starts.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except (ImportError, AttributeError):  # pragma: no cover - transformers is a dependency
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass
    for name in ("transformers", "huggingface_hub", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class PhaseProgress:
    """The run's console; a ``metrics.Sink`` plus ``phase`` and ``message``.

    ``PhaseProgress`` is the console sink of ``MetricsLogger`` for a run: on a
    terminal one tqdm bar per phase, "warm-start" (``sft`` logs), "RL"
    (``train`` logs) and "eval" (``phase("eval", n)`` around an evaluation), each
    with ETA and the key metrics in its postfix; an eval's results are one line
    above the bars. Not on a terminal, a compact line every ``every`` steps of a
    phase (0: about 20 lines per phase) and one line per eval. Per-step numbers
    never print otherwise; every one still reaches metrics.jsonl.
    """

    def __init__(self, rl_steps: int, sft_steps: int = 0, every: int = 0, stream: TextIO | None = None,
                 tty: bool | None = None) -> None:
        self.totals = {"RL": rl_steps, "warm-start": sft_steps}
        self.every = every
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self._bars: dict[str, tqdm] = {}
        self._latest: dict[str, dict[str, float]] = {"RL": {}, "warm-start": {}}
        self._eval: dict[str, float] = {}
        self._t0: dict[str, tuple[float, int]] = {}  # phase -> (first seen, its step)
        self._printed: dict[str, int] = {}  # the step of each phase's last plain line

    # -- Sink ---------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, float], kind: str = "train") -> None:
        if kind == "eval":
            self._eval = dict(metrics)
            self.message(eval_line(step, metrics))
            return
        name = {"train": "RL", "sft": "warm-start"}.get(kind)
        if name is None:
            return
        if name == "RL":
            self._close("warm-start")
        self._latest[name].update(metrics)
        done = step if name == "RL" else step + 1 if "sft_loss" in metrics else step
        self._advance(name, done)

    def close(self) -> None:
        for name in list(self._bars):
            self._close(name)

    # -- phases -------------------------------------------------------------
    def _postfix(self, name: str) -> str:
        keys = RL_KEYS if name == "RL" else SFT_KEYS
        m = self._latest[name]
        parts = [f"{label}={format_value(k, m[k])}" for k, label in keys if k in m]
        if name == "RL" and "eval_reward" in self._eval:
            parts.append(f"eval={format_value('r', self._eval['eval_reward'])}")
        return " ".join(parts)

    def _advance(self, name: str, done: int) -> None:
        total = self.totals.get(name) or None
        if self.tty:
            bar = self._bars.get(name)
            if bar is None:
                bar = self._bars[name] = tqdm(total=total, initial=max(done - 1, 0), desc=name, unit="step",
                                              file=self.stream, dynamic_ncols=True, leave=True)
            bar.set_postfix_str(self._postfix(name), refresh=False)
            if done > bar.n:
                bar.update(done - bar.n)
            else:
                bar.refresh()
            return
        start, first = self._t0.setdefault(name, (time.monotonic(), done))
        every = self.every or max(1, (total or LINES_PER_PHASE) // LINES_PER_PHASE)
        last = self._printed.get(name, 0)
        if done - last >= every or done == total or last == 0:
            self._printed[name] = done
            elapsed = time.monotonic() - start
            rate = elapsed / (done - first) if done > first else None
            eta = f" eta {tqdm.format_interval(rate * (total - done))}" if total and rate else ""
            of = f"/{total}" if total else ""
            say(f"[{name}] step {done}{of} {tqdm.format_interval(elapsed)}{eta} | {self._postfix(name)}",
                self.stream)

    def _close(self, name: str) -> None:
        bar = self._bars.pop(name, None)
        if bar is not None:
            if bar.total and bar.n < bar.total:  # stopped early (warm-start target, time limit)
                bar.total = bar.n
            bar.close()

    @contextlib.contextmanager
    def phase(self, name: str, total: int) -> Iterator[Any]:
        """A transient bar for a short phase (an evaluation); ``.update()`` advances it."""
        if not self.tty:
            yield _NoBar()
            return
        bar = tqdm(total=total, desc=name, unit="pass", file=self.stream, leave=False, dynamic_ncols=True)
        try:
            yield bar
        finally:
            bar.close()

    def message(self, text: str) -> None:
        if self._bars:
            tqdm.write(text, file=self.stream)
            self.stream.flush()
        else:
            say(text, self.stream)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


def fmt_number(v: Any) -> str:
    """Three decimals, or '-' for a number that is missing or NaN."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.3f}"


def eval_line(step: int, m: Mapping[str, float]) -> str:
    parts = [f"greedy reward {fmt_number(m.get('eval_reward'))}"]
    if "eval_sampled_reward" in m:
        parts.append(f"sampled {fmt_number(m['eval_sampled_reward'])}")
    if "eval_exact" in m:
        parts.append(f"exact {fmt_number(m['eval_exact'])}")
    return f"eval @ step {step}: " + ", ".join(parts)


LAYOUT = (
    ("final/", "the trained model (Hugging Face format, with its tokenizer)"),
    ("warmstart/", "the model after the warm-start, before RL"),
    ("checkpoints/step_N/", "resumable checkpoints (loop.checkpoint_every)"),
    ("config.yaml", "the resolved config of the run"),
    ("summary.json", "the numbers above and more"),
    ("metrics.jsonl", "every logged step (train, sft, eval)"),
    ("traces.jsonl", "sampled trajectories per step: `conveyor samples RUN_DIR --step N`"),
    ("tensorboard/", "the same as TensorBoard event files"),
    ("timeline.json", "what every role did when (ui.perfetto.dev); `conveyor report RUN_DIR`: one HTML page"),
    ("logs/", "logs of role processes"),
)


def summary_text(summary: Mapping[str, Any], run_dir: Path, examples: Sequence[Any] = ()) -> str:
    """The end of a run, for people; the first of ``examples``
    (held-out tasks) gives the prompt of the ``conveyor generate`` example.

    ``summary_text(summary, run_dir, examples)`` renders the end of a run: a
    table of greedy / sampled reward and exact-answer rate (initial, after the
    warm-start, after RL), length-skipped prompts, the run directory's layout,
    and the commands that try the model.
    """
    example = examples[0].info.get("raw_prompt", examples[0].prompt) if examples else "Hello"
    rows = [("greedy reward", "eval_reward"), ("sampled reward", "eval_sampled_reward"),
            ("exact answers", "eval_exact")]
    cols = [(c, p) for c, p in (("initial", "initial"), ("warm-start", "warmstart"), ("after RL", "final"))
            if p != "warmstart" or any(k.endswith("_warmstart") for k in summary)]  # no warm-start, no column
    lines = ["", f"{'held-out':<16}" + "".join(f"{c:>12}" for c, _ in cols)]
    for label, key in rows:
        vals = [summary.get(f"{key}_{p}") for _, p in cols]
        if all(v is None for v in vals):
            continue
        lines.append(f"{label:<16}" + "".join(f"{fmt_number(v):>12}" for v in vals))
    lines.append(f"{summary.get('steps', 0)} RL steps, {summary.get('wall_seconds', 0):.0f}s in all")
    train_skipped = (summary.get("final_metrics") or {}).get("prompt_too_long")
    for count, what in ((train_skipped, "training prompts"),
                        (summary.get("eval_prompt_too_long_final"), "held-out prompts")):
        if count:
            limit = f" ({summary['max_prompt_tokens']} prompt tokens)" if "max_prompt_tokens" in summary else ""
            lines.append(f"note: {int(count)} {what} were skipped: longer than the model's context{limit}; "
                         f"{LENGTH_FIX}")
    lines += ["", f"run directory {run_dir}/"]
    for name, what in LAYOUT:
        if (run_dir / name.split("step_N")[0].rstrip("/")).exists():
            lines.append(f"  {name:<22}{what}")
    rd = shlex.quote(str(run_dir))
    lines += ["", "try the model:",
              f"  conveyor generate {rd} {shlex.quote(example)}",
              f"  conveyor eval {rd}",
              f"  conveyor export {rd} OUT_DIR"]
    return "\n".join(lines)


def report_length_skips(logger, limit: int, skipped: int, total: int, prefix: str, reported: dict) -> None:
    """Say (once per evaluation kind) how many held-out prompts did not fit the engine's context;
    when none fits, stop with an error naming the fields instead of reporting a nan reward.
    ``reported`` (the caller's) remembers what was said, so a note is not repeated."""
    if not skipped:
        return
    what = "training tasks held out for the warm-start check" if prefix.startswith("sft") else "held-out prompts"
    if skipped == total:
        from conveyor.data.api import DataError
        raise DataError(f"all {total} {what} are longer than the model's context ({limit} "
                        f"prompt tokens), so nothing is left to evaluate; {LENGTH_FIX}")
    key = ("sft_check_" if prefix.startswith("sft") else "eval_") + "prompt_too_long"  # greedy and sampled: once
    if reported.get(key) != skipped:
        logger.message(f"note: {skipped} of {total} {what} skipped: longer than the model's context "
                       f"({limit} prompt tokens); {LENGTH_FIX}")
    reported[key] = skipped
