"""MetricsLogger and its sinks: JSONL values, TensorBoard scalars, console output, fan-out rules."""
import io
import json
import sys
import time

import pytest

from conveyor.config import ObserveConfig
from conveyor.observe import metrics as metrics_mod
from conveyor.observe.metrics import (
    JsonlSink,
    MetricsLogger,
    MlflowSink,
    ProgressSink,
    Sink,
    WandbSink,
    format_value,
    qualified,
)
from conveyor.observe.report import read_metrics


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


class RecordingSink:
    def __init__(self, fail_on_close: bool = False) -> None:
        self.calls: list[tuple[int, dict, str]] = []
        self.closed = False
        self.fail_on_close = fail_on_close

    def log(self, step, metrics, kind="train"):
        self.calls.append((step, dict(metrics), kind))

    def close(self):
        self.closed = True
        if self.fail_on_close:
            raise OSError("tracker unreachable")


def quiet_logger(tmp_path, **kw):
    kw.setdefault("tensorboard", False)
    kw.setdefault("progress", False)
    return MetricsLogger(tmp_path, **kw)


def test_jsonl_lines_hold_step_kind_time_and_values(tmp_path):
    import torch
    before = time.time()
    with quiet_logger(tmp_path) as log:
        log.log(1, {"reward": 0.5, "loss": -0.125, "tokens": 640})
        log.log(1, {"reward": 0.25}, kind="eval")
        log.log(2, {"reward": torch.tensor(0.75), "kl": float("nan"), "grad_norm": float("inf"),
                    "clipped": True})
        # Flushed per line: readable before close, as after a crash.
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    after = time.time()
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [list(r)[:3] for r in lines] == [["step", "kind", "time"]] * 3
    assert all(before <= r.pop("time") <= after for r in lines)
    assert lines == [
        {"step": 1, "kind": "train", "reward": 0.5, "loss": -0.125, "tokens": 640},
        {"step": 1, "kind": "eval", "reward": 0.25},
        {"step": 2, "kind": "train", "reward": 0.75, "kl": None, "grad_norm": None, "clipped": 1},
    ]
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_resume_appends_and_drops_torn_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "kind": "train", "time": 0, "reward": 0.5}\n{"step": 2, "ki')
    sink = JsonlSink(path)
    sink.log(2, {"reward": 0.625})
    sink.close()
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path)] == [(1, 0.5), (2, 0.625)]


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with MetricsLogger(tmp_path, progress=False) as log:
        log.log(3, {"reward": 0.5, "time/step": 1.25})
        log.log(4, {"reward": 0.75})
        log.log(4, {"reward": 0.375}, kind="eval")
        log.log(5, {"eval_len": 12.5}, kind="eval")  # kind already in the key: no double prefix
    tb_dir = tmp_path / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/reward", "train/time/step", "eval/reward", "eval/len"}
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [(3, 0.5), (4, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/reward")] == [(4, 0.375)]
    assert acc.Scalars("train/time/step")[0].value == pytest.approx(1.25)
    assert [(e.step, e.value) for e in acc.Scalars("eval/len")] == [(5, 12.5)]


def test_a_resumed_run_replaces_the_later_steps_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with MetricsLogger(tmp_path, progress=False) as log:
        for step in range(1, 7):  # killed after step 6; its checkpoint was at step 4
            log.log(step, {"reward": float(step)})
    time.sleep(1.1)  # a new event file name (its suffix is the second it was opened)
    with MetricsLogger(tmp_path, progress=False, purge_step=4) as log:
        for step in (5, 6, 7):
            log.log(step, {"reward": 10.0 * step})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0), (7, 70.0)]


def test_missing_tensorboard_warns_once_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    monkeypatch.setattr(metrics_mod, "_warned", set())
    with pytest.warns(RuntimeWarning, match="TensorBoard logging is off"):
        log = MetricsLogger(tmp_path / "a", progress=False)
    log.log(1, {"reward": 0.5})
    log.close()
    assert read_metrics(tmp_path / "a")[0]["reward"] == 0.5
    assert not (tmp_path / "a" / "tensorboard").exists()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second logger must not warn again
        MetricsLogger(tmp_path / "b", progress=False).close()


def test_plain_lines_when_not_a_tty(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(tmp_path, tensorboard=False, total_steps=4, log_every=2, stream=out)
    for step in range(1, 5):
        log.log(step, {"reward": 0.5 + step / 8, "loss": -0.0123, "kl": 0.00123,
                       "samples_per_s": 312.4, "time/step": 1.93, "entropy": 2.0})
        if step == 2:
            log.log(step, {"reward": 0.25, "length": 12.0}, kind="eval")
    log.message("saved checkpoint step 4")
    log.close()
    lines = out.getvalue().splitlines()
    # step 1 (first), step 2 (due), the eval, step 4 (due and last); step 3 is thinned out.
    assert [ln.split(" |")[0].rsplit(" ", 1)[0] for ln in lines[:4]] == [
        "[train] step 1/4", "[train] step 2/4", "[eval] step 2/4", "[train] step 4/4"]
    assert lines[1].endswith("| reward=0.75 loss=-0.0123 kl=1.2e-3 samples_per_s=312 time/step=1.93s")
    assert lines[2].endswith("| reward=0.25 length=12")
    assert lines[3].endswith(
        "| reward=1 eval/reward=0.25 loss=-0.0123 kl=1.2e-3 samples_per_s=312 time/step=1.93s")
    assert lines[4] == "saved checkpoint step 4"
    assert len(lines) == 5
    assert "\r" not in out.getvalue()  # no bar drawing in logs


def test_plain_line_falls_back_to_logged_metrics_when_no_key_matches():
    out = io.StringIO()
    sink = ProgressSink(keys=("reward",), stream=out)
    sink.log(7, {"sft_loss": 1.5, "lr": 0.001})
    assert out.getvalue().endswith("[train] step 7 00:00 | sft_loss=1.5 lr=1.0e-3\n")


def test_other_kinds_print_without_the_rl_total():
    out = io.StringIO()
    sink = ProgressSink(total_steps=50, stream=out)
    sink.log(10, {"loss": 0.5}, kind="sft")
    assert out.getvalue() == "[sft] step 10 00:00 | loss=0.5\n"


def test_tty_draws_a_bar_with_live_postfix(tmp_path):
    out = TtyStream()
    with MetricsLogger(tmp_path, tensorboard=False, total_steps=10, stream=out) as log:
        log.message("loading model")  # before the first step: printed as is
        log.log(1, {"reward": 0.5, "loss": 0.25})
        log.log(2, {"reward": 0.625, "loss": 0.25})
        log.log(2, {"reward": 0.375}, kind="eval")
        assert log.progress is not None and log.progress._bar.n == 2
        log.message("checkpoint saved")
    text = out.getvalue()
    assert text.startswith("loading model\n")
    assert "2/10" in text
    assert "reward=0.625 eval/reward=0.375 loss=0.25" in text
    assert "[eval] step 2/10" in text and "checkpoint saved\n" in text


def test_resumed_run_bar_starts_at_first_step(tmp_path):
    sink = ProgressSink(total_steps=100, stream=TtyStream())
    sink.log(51, {"reward": 0.5})
    assert (sink._bar.initial, sink._bar.n) == (50, 51)
    sink.close()


def test_fan_out_to_extra_sinks_and_close_all_even_when_one_fails(tmp_path):
    good, bad = RecordingSink(), RecordingSink(fail_on_close=True)
    assert isinstance(good, Sink)
    log = quiet_logger(tmp_path, sinks=[bad, good])
    log.log(5, {"reward": 1}, kind="eval")
    assert good.calls == bad.calls == [(5, {"reward": 1}, "eval")]
    with pytest.raises(OSError, match="tracker unreachable"):
        log.close()
    assert good.closed and bad.closed
    log.close()  # second close is a no-op
    with pytest.raises(RuntimeError, match="closed"):
        log.log(6, {"reward": 1})


def test_bad_metrics_rejected_with_their_name(tmp_path):
    with quiet_logger(tmp_path) as log:
        with pytest.raises(ValueError, match="'time' is reserved"):
            log.log(1, {"time": 1.0})
        with pytest.raises(TypeError, match="'note' must be a number"):
            log.log(1, {"note": "hello"})
        with pytest.raises(ValueError, match="kind"):
            log.log(1, {"reward": 1.0}, kind="eval/x")
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_observe_config_fields_are_logger_keywords(tmp_path):
    cfg = ObserveConfig(progress=False, tensorboard=False, log_every=3)
    with MetricsLogger(tmp_path, **cfg.model_dump(), total_steps=9) as log:
        log.log(1, {"reward": 0.5})
    assert [type(s).__name__ for s in log.sinks] == ["JsonlSink"]


@pytest.mark.parametrize("key,value,text", [
    ("reward", 0.51234, "0.512"), ("loss", -0.01234, "-0.0123"), ("kl", 0.00123, "1.2e-3"),
    ("samples/s", 312.4, "312"), ("time/step", 1.934, "1.93s"), ("tokens", 123456.0, "1.2e5"),
    ("n", 3, "3"), ("x", float("nan"), "nan"), ("x", 0.0, "0"),
])
def test_format_value_is_compact(key, value, text):
    assert format_value(key, value) == text


@pytest.mark.parametrize("kind,key,name", [
    ("eval", "reward", "eval/reward"), ("eval", "eval_reward", "eval/reward"),
    ("eval", "eval/len", "eval/len"), ("train", "time/step", "train/time/step"),
    ("eval", "evaluated", "eval/evaluated"), ("sft", "eval_loss", "sft/eval_loss"),
])
def test_qualified_names(kind, key, name):
    assert qualified(kind, key) == name


@pytest.mark.parametrize("cls,module", [(WandbSink, "wandb"), (MlflowSink, "mlflow")])
def test_tracking_sinks_name_the_extra_when_missing(monkeypatch, cls, module):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"pip install 'conveyor\[tracking\]'"):
        cls()


def test_eval_reward_from_the_loop_shows_as_eval_reward_in_the_postfix():
    sink = ProgressSink(keys=("reward", "eval/reward"), stream=io.StringIO())
    sink.log(0, {"eval_reward": 0.125, "eval_len": 9.0}, kind="eval")
    sink.log(1, {"reward": 0.5})
    assert sink.postfix() == "reward=0.5 eval/reward=0.125"
