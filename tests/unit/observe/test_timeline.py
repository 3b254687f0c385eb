"""The role timeline: the file is Trace Event Format JSON (one process per role, one thread per
track, complete events in microseconds, counters), it is written as it goes (bounded memory),
stops growing at its cap, survives a killed writer and a resumed run, and the module functions
record only while a timeline is active. The places that report spans (engine worker, trainer
host, environment pool, phase timer) are checked with real parts."""
from __future__ import annotations

import json

import pytest

from conveyor.observe import timeline
from conveyor.observe.timeline import TIMELINE_FILE, Timeline, read_timeline
from conveyor.observe.timers import PhaseTimer


@pytest.fixture(autouse=True)
def no_active_timeline():
    yield
    timeline.activate(None)


def by_name(events, ph="X"):
    return [e for e in events if e["ph"] == ph]


def names_of(events):
    """pid -> process name, (pid, tid) -> thread name, from the metadata events."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    return procs, threads


def test_file_is_trace_event_json_with_a_process_per_role_and_a_thread_per_track(tmp_path):
    tl = Timeline(tmp_path)
    tl.span("trainer", "rank 0", "train", 100.0, 100.25, {"version": 1})
    tl.span("trainer", "rank 1", "train", 100.0, 100.5)
    tl.span("rollout", "engine 0", "generate", 99.5, 100.0)
    tl.counter("controller", "groups", {"in flight": 3, "buffered": 1}, at=100.125)
    tl.close()
    events = json.loads((tmp_path / TIMELINE_FILE).read_text())  # the whole file is one JSON array
    procs, threads = names_of(events)
    xs = by_name(events)
    assert [(procs[e["pid"]], threads[(e["pid"], e["tid"])], e["name"]) for e in xs] == [
        ("trainer", "rank 0", "train"), ("trainer", "rank 1", "train"), ("rollout", "engine 0", "generate")]
    assert xs[0]["ts"] == 100_000_000.0 and xs[0]["dur"] == 250_000.0 and xs[0]["args"] == {"version": 1}
    assert xs[1]["pid"] == xs[0]["pid"] and xs[1]["tid"] != xs[0]["tid"]  # two rows of one process
    assert xs[2]["pid"] != xs[0]["pid"]
    (counter,) = by_name(events, "C")
    assert procs[counter["pid"]] == "controller" and counter["ts"] == 100_125_000.0
    assert counter["args"] == {"in flight": 3, "buffered": 1}
    assert events[-1]["name"] == "timeline_end" and events[-1]["args"] == {"dropped": 0}


def test_events_reach_the_file_before_close_and_memory_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "FLUSH_EVENTS", 10)
    tl = Timeline(tmp_path)
    for i in range(35):
        tl.span("reward", "worker", "score", i, i + 0.5)
        assert len(tl._pending) < 10
    assert len(by_name(read_timeline(tmp_path))) == 30  # three flushes of 10; 5 still wait
    tl.close()
    assert len(by_name(read_timeline(tmp_path))) == 35


def test_past_the_cap_events_are_dropped_and_counted(tmp_path):
    tl = Timeline(tmp_path, max_mb=2000 / 2**20)  # 2000 bytes
    for i in range(100):
        tl.span("reward", "worker", "score", i, i + 0.5)
    tl.close()
    events = json.loads((tmp_path / TIMELINE_FILE).read_text())
    kept = len(by_name(events))
    assert 5 < kept < 100
    assert events[-1]["args"]["dropped"] == 100 - kept  # the metadata came first and was kept
    assert (tmp_path / TIMELINE_FILE).stat().st_size <= 2000 + 100  # the cap, plus the closing mark


def test_a_killed_writer_leaves_a_readable_file_and_a_resumed_run_appends_to_it(tmp_path):
    first = Timeline(tmp_path)
    first.span("controller", "loop", "train", 1.0, 2.0)
    first.flush()  # the process is killed here: no close, no closing bracket
    path = tmp_path / TIMELINE_FILE
    with path.open("a") as f:
        f.write(',{"ph":"X","name":"tr')  # and its last line was torn
    assert [e["name"] for e in by_name(read_timeline(tmp_path))] == ["train"]

    second = Timeline(tmp_path)  # the resumed run
    second.span("controller", "loop", "train", 3.0, 4.0)
    second.span("trainer", "rank 0", "train", 3.0, 3.5)
    second.close()
    events = json.loads(path.read_text())
    trains = [e for e in by_name(events) if e["name"] == "train"]
    assert [e["ts"] for e in trains] == [1e6, 3e6, 3e6]
    assert trains[0]["tid"] == trains[1]["tid"]  # a track keeps its id across the two writers

    third = Timeline(tmp_path)  # a run resumed after a clean end continues the same array
    third.span("controller", "loop", "wait", 5.0, 6.0)
    third.close()
    events = json.loads(path.read_text())
    assert [e["name"] for e in by_name(events)] == ["train", "train", "train", "wait"]
    assert [e["name"] for e in events if e["name"] == "timeline_end"] == ["timeline_end"]


def test_module_functions_record_only_while_a_timeline_is_active(tmp_path):
    timeline.record("reward", "w", "score", 1.0, 2.0)  # nothing active: nothing happens
    with timeline.measure("controller", "eval"):
        pass
    tl = Timeline(tmp_path)
    timeline.activate(tl)
    timeline.record("reward", "w", "score", 1.0, 2.0)
    with pytest.raises(RuntimeError), timeline.measure("controller", "eval", args={"step": 3}):
        raise RuntimeError("a failing block is still a span")
    timeline.phase_span("wait", 0.25)
    timeline.deactivate(tl)
    timeline.record("reward", "w", "late", 1.0, 2.0)
    tl.close()
    events = read_timeline(tmp_path)
    procs, threads = names_of(events)
    got = [(procs[e["pid"]], threads[(e["pid"], e["tid"])], e["name"], round(e["dur"] / 1e6, 2))
           for e in by_name(events)]
    assert got[0] == ("reward", "w", "score", 1.0)
    assert got[1][:3] == ("controller", "loop", "eval")  # the main thread is the loop's row
    assert got[2] == ("controller", "loop", "wait", 0.25)
    assert len(got) == 3
    assert by_name(events)[1]["args"] == {"step": 3}


def test_phase_timer_reports_each_outermost_phase_once():
    now = [0.0]
    heard = []
    timer = PhaseTimer(clock=lambda: now[0], on_span=lambda name, s: heard.append((name, s)))
    with timer.phase("train"):
        now[0] += 1.0
        with timer.phase("train"):  # re-entered: no second span
            now[0] += 0.5
        with timer.phase("publish"):
            now[0] += 0.25
    assert heard == [("publish", 0.25), ("train", 1.75)]
    assert timer.lap()["time/train"] == 1.75


def test_rounding_to_microseconds_keeps_spans_nested_or_in_sequence(tmp_path):
    tl = Timeline(tmp_path)
    t = 1_795_800_000.0000004  # wall time, where a double holds about a quarter microsecond
    tl.span("trainer", "rank 0", "train", t, t + 0.0123456)
    tl.span("trainer", "rank 0", "publish", t + 0.0123456, t + 0.0200001)  # starts where train ends
    tl.span("trainer", "rank 0", "part", t + 0.0150003, t + 0.0200001)  # inside publish, ends with it
    tl.close()
    train, publish, part = by_name(read_timeline(tmp_path))
    assert train["ts"] + train["dur"] <= publish["ts"]
    assert publish["ts"] <= part["ts"] and part["ts"] + part["dur"] <= publish["ts"] + publish["dur"]
    assert all(isinstance(e[k], int) for e in (train, publish, part) for k in ("ts", "dur"))
