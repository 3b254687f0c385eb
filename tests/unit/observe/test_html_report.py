"""`conveyor report`: the page's data from a run directory's files (values checked), text from
completions never becoming markup, missing parts as notes, a one-line error for a directory that
is not a run's, and the page itself drawn by headless Chromium without a script error (Debian's
`chromium` package; README, Install)."""
from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess

import pytest

from conveyor.cli import main
from conveyor.config import load_config, save_config
from conveyor.observe.html_report import ReportError, collect, embed_json, render, write_report
from conveyor.observe.metrics import JsonlSink
from conveyor.observe.report import write_summary
from conveyor.observe.timeline import Timeline

INJECTION = '</script><script>document.body.setAttribute("data-pwned","1")</script><img src=x onerror="alert(1)">'
STEPS = 6


def train_record(step: int) -> dict:
    stale = {"staleness_hist/0": 0.75, "staleness_hist/1": 0.25} if step % 2 else {"staleness_hist/0": 1.0}
    return {"reward": 0.1 * step, "reward_std": 0.05, "response_len": 5.0 + step, "response_len_p50": 5.0,
            "response_len_p99": 9.0, "response_len_max": 10.0, "truncated_frac": 0.0, **stale,
            "trainer_idle_frac": 0.2, "engine0_idle_frac": 0.5, "engine1_idle_frac": 0.25, "samples_per_s": 100.0,
            "time/step": 2.0, "time/wait": 0.4, "time/prepare": 0.1, "time/train": 1.5}


def trace(step: int, i: int, reward: float, completion: str) -> dict:
    return {"step": step, "task_id": f"task-{step}-{i}", "prompt": f"rev:abc{i}=", "completion": completion,
            "prompt_tokens": 6, "completion_tokens": 4, "policy_tokens": 4,
            "versions": {"min": step - 1, "max": step - 1, "distinct": 1}, "reward": reward,
            "reward_info": {"exact": float(reward == 1.0)}, "finish_reason": "stop", "turns": [], "timings": {}}


def write_timeline(run_dir) -> None:
    """Six steps of 2 s from t = 1000 s: the loop waits 0.5 s then trains 1.5 s; the trainer trains
    1 s of each step; the engine generates 1 s; a reward worker scores."""
    tl = Timeline(run_dir)
    for k in range(STEPS):
        t = 1000.0 + 2 * k
        tl.span("controller", "loop", "wait", t, t + 0.5)
        tl.span("controller", "loop", "train", t + 0.5, t + 2.0)
        tl.span("trainer", "rank 0", "train", t + 0.5, t + 1.5)
        tl.span("trainer", "rank 0", "publish", t + 1.5, t + 1.6)
        tl.span("rollout", "engine 0", "generate", t, t + 1.0)
        tl.span("reward", "reward-fn-0", "score", t + 1.0, t + 1.01)
    tl.counter("controller", "groups", {"in flight": 2})
    tl.close()


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    save_config(load_config(None, ["loop.steps=6"]), d / "config.yaml")
    sink = JsonlSink(d / "metrics.jsonl")
    sink.log(0, {"eval_reward": 0.1, "eval_sampled_reward": 0.05, "eval_exact": 0.0}, "eval")
    for step in range(1, STEPS + 1):
        sink.log(step, train_record(step))
        if step % 3 == 0:
            sink.log(step, {"eval_reward": 0.1 + 0.1 * step, "eval_sampled_reward": 0.1 * step, "eval_exact": 0.5},
                     "eval")
    sink.close()
    write_summary(d, {"eval_reward_initial": 0.1, "eval_reward_final": 0.7, "steps": STEPS, "wall_seconds": 30.0,
                      "rl_seconds": 12.0, "run_dir": str(d)})
    with (d / "traces.jsonl").open("w") as f:
        for step in range(1, STEPS + 1):
            for i, (reward, text) in enumerate([(1.0, "cba"), (0.0, INJECTION), (0.5, "bca"), (0.25, "acb")]):
                f.write(json.dumps(trace(step, i, reward, text)) + "\n")
    write_timeline(d)
    return d


def test_the_page_data_holds_the_runs_numbers(run_dir):
    d = collect(run_dir)
    assert d["notes"] == {}
    assert d["train"]["step"] == list(range(1, STEPS + 1))
    assert d["train"]["reward"] == pytest.approx([0.1 * s for s in range(1, STEPS + 1)])
    assert d["eval"]["step"] == [0, 3, 6] and d["eval"]["eval_reward"] == pytest.approx([0.1, 0.4, 0.7])
    # odd steps 3/4 on-policy, even steps all on-policy: (3 * 0.75 + 3 * 1) / 6 and 3 * 0.25 / 6
    assert d["staleness"] == [[0, pytest.approx(0.875)], [1, pytest.approx(0.125)]]
    assert list(d["engines_idle"]) == ["engine0", "engine1"] and d["engines_idle"]["engine1"] == [0.25] * STEPS
    assert d["heldout"] == [{"label": "greedy reward", "initial": 0.1, "warmstart": None, "final": 0.7}]
    assert ["loop.steps", "6"] in d["config"] and ["RL steps", STEPS] in d["totals"]


def test_the_timeline_rows_busy_shares_and_close_up(run_dir):
    tl = collect(run_dir)["timeline"]
    rows = {(t["role"], t["track"]): t for t in tl["tracks"]}
    assert list(rows) == [("controller", "loop"), ("trainer", "rank 0"), ("rollout", "engine 0"),
                          ("reward", "reward-fn-0")]  # processes in role order
    assert tl["span_s"] == pytest.approx(12.0)
    # RL runs from the first wait (1000 s) to the end of the last train (1012 s); waits are idle
    assert tl["busy_window"] == [pytest.approx(0.0), pytest.approx(12.0)]
    assert rows[("controller", "loop")]["busy"] == pytest.approx(0.75)
    assert rows[("trainer", "rank 0")]["busy"] == pytest.approx(0.55)
    assert rows[("rollout", "engine 0")]["busy"] == pytest.approx(0.5)
    assert rows[("trainer", "rank 0")]["count"] == 2 * STEPS
    # the close-up: the last three steps, from the end of step 3's train to the end of step 6's
    assert tl["closeup"] == [pytest.approx(6.0), pytest.approx(6.0)]
    closeup = rows[("trainer", "rank 0")]["closeup"]
    assert [(round(s, 3), round(d, 3), tl["names"][n]) for s, d, n, _, _ in closeup] == [
        (0.5, 1.0, "train"), (1.5, 0.1, "publish"), (2.5, 1.0, "train"), (3.5, 0.1, "publish"),
        (4.5, 1.0, "train"), (5.5, 0.1, "publish")]


def test_samples_are_the_best_the_worst_and_one_other_of_each_chosen_step(run_dir):
    d = collect(run_dir)
    assert [g["step"] for g in d["samples"]] == [1, 4, 6]  # default: first, middle, last traced
    picked = d["samples"][0]["samples"]
    assert [(s["kind"], s["reward"]) for s in picked][:2] == [("best", 1.0), ("worst", 0.0)]
    assert picked[2]["kind"] == "random" and picked[2]["reward"] in (0.5, 0.25)
    assert picked[1]["completion"] == INJECTION and picked[0]["versions"] == "v0"
    chosen = collect(run_dir, steps=[2, 99])
    assert [g["step"] for g in chosen["samples"]] == [2]
    assert chosen["notes"]["samples"] == "no traces of step 99; traced steps: 1 to 6 (6 steps)"


def test_no_text_of_a_completion_can_become_markup():
    text = embed_json({"completion": INJECTION, "amp": "a & b", "sep": "\u2028"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"completion": INJECTION, "amp": "a & b", "sep": "\u2028"}


def test_missing_parts_are_notes_and_a_stranger_directory_is_one_line(tmp_path, capsys):
    d = tmp_path / "bare"
    d.mkdir()
    sink = JsonlSink(d / "metrics.jsonl")
    sink.log(1, {"reward": 0.5})
    sink.close()
    notes = collect(d)["notes"]
    assert sorted(notes) == ["eval", "samples", "summary", "timeline"]
    assert "observe.timeline=false" in notes["timeline"] and "observe.traces_per_step=0" in notes["samples"]
    with pytest.raises(ReportError, match="is not a run directory"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("conveyor: error: ") and "nowhere is not a directory" in err[0]
    assert "give the run directory `conveyor train` wrote" in err[0]
    assert main(["report", str(d), "--steps", "1,x"]) == 2
    assert "--steps '1,x'" in capsys.readouterr().err


# ----- the page in a browser ------------------------------------------------------------------------
def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed: apt-get install -y chromium (README, Install)"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=10000",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def body_of(dom: str) -> str:
    found = re.search(r"<body([^>]*)>", dom)
    assert found, dom[:500]
    return found.group(1)


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_the_page_draws_in_chromium_without_errors_and_the_completion_stays_text(run_dir, tmp_path):
    page = write_report(run_dir)
    assert page == run_dir / "report.html"
    assert "http://" not in page.read_text().replace("http://www.w3.org/2000/svg", "")  # nothing to fetch
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    body = body_of(dom)
    assert 'data-rendered="1"' in body and "data-errors" not in body and "data-pwned" not in body
    assert dom.count("<svg") >= 8  # reward, exact, staleness, lengths, truncated, samples/s, idle, 2 timelines
    assert "&lt;/script&gt;&lt;script&gt;" in dom and "<img src=\"x\"" not in dom
    assert "greedy reward" in dom and "busy share of each row" in dom and "step 4" in dom
    shot = tmp_path / "report.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri())
    assert png_size(shot) == (1280, 2400) and shot.stat().st_size > 50_000


def test_a_page_with_missing_parts_still_draws_its_notes(tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    sink = JsonlSink(d / "metrics.jsonl")
    sink.log(1, {"reward": 0.5})
    sink.close()
    dom = chromium(tmp_path, "--dump-dom", write_report(d).as_uri()).stdout
    body = body_of(dom)
    assert 'data-rendered="1"' in body and "data-errors" not in body
    assert "the run recorded no timeline" in dom and "the run traced no completions" in dom


def test_a_script_error_on_the_page_is_caught(run_dir, tmp_path):
    """The harness above can fail: a page whose drawing breaks is marked, not silently blank."""
    data = collect(run_dir)
    del data["samples"]  # the drawing code reads it
    page = tmp_path / "broken.html"
    page.write_text(render(data))
    body = body_of(chromium(tmp_path, "--dump-dom", page.as_uri()).stdout)
    assert 'data-errors="1"' in body and "data-rendered" not in body
