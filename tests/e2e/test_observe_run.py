"""A whole run with roles in processes of their own (two trainer ranks, an engine) and every
observer on: the timeline holds spans of every role and rank, W&B (offline) and MLflow (a file
store) hold the resolved config and the final summary, and `conveyor report` draws the run."""
from __future__ import annotations

import collections
import glob
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.observe.timeline import read_timeline

pytestmark = pytest.mark.slow  # a whole training run

RUN = ["sft.steps=3", "sft.batch_size=8", "loop.batch_size=4", "rollout.n=4", "data.eval_size=16",
       "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
       "loop.time_limit_s=null", "loop.steps=4", "loop.eval_every=2", "observe.progress=false",
       "observe.tensorboard=false", "launch.placement=disaggregated", "launch.trainer_ranks=2",
       "launch.weight_sync=broadcast", "observe.sinks=[wandb,mlflow]", "observe.project=observe-e2e"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("observe")
    env = pytest.MonkeyPatch()
    env.setenv("WANDB_MODE", "offline")
    env.setenv("WANDB_SILENT", "true")
    env.setenv("MLFLOW_TRACKING_URI", (base / "mlruns").as_uri())
    env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        assert main(["train", *RUN, f"--output-dir={base / 'run'}"]) == 0
        yield base
    finally:
        env.undo()


def test_the_timeline_has_every_role_and_rank(run):
    events = read_timeline(run / "run")
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = collections.Counter((procs[e["pid"]], rows[(e["pid"], e["tid"])], e["name"])
                                for e in events if e["ph"] == "X")
    for step_phase in ("wait", "train"):
        assert spans[("controller", "loop", step_phase)] == 4
    assert spans[("controller", "loop", "eval")] == 4  # initial, after the warm start, step 2, final
    assert spans[("controller", "loop", "warm_start")] == 1
    for rank in (0, 1):  # each rank answers with its own spans, carried in its Trained
        assert spans[("trainer", f"rank {rank}", "train")] == 4
        assert spans[("trainer", f"rank {rank}", "publish")] >= 4
    assert spans[("rollout", "engine 0", "generate")] >= 4  # carried in Done from the engine's process
    assert spans[("rollout", "engine 0", "generate (eval)")] >= 4
    assert spans[("rollout", "engine 0 weights", "weights: swap")] >= 4
    scored = sum(n for (role, _, name), n in spans.items() if role == "reward" and name == "score")
    assert scored >= 4 * 4 * 4  # every training sample (and the held-out ones)
    # Perfetto draws a thread's spans as a stack: on every row two spans nest or follow each other
    by_row = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
            by_row[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for row, spans in by_row.items():
        open_ends: list[int] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], (rows[row], name, start, end, open_ends[-1])
            open_ends.append(end)
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"groups", "policy version"}
    json.loads((run / "run" / "timeline.json").read_text())  # closed: one valid JSON array


def test_the_trackers_hold_the_config_and_the_summary(run):
    from mlflow.tracking import MlflowClient
    summary = json.loads((run / "run" / "summary.json").read_text())
    client = MlflowClient((run / "mlruns").as_uri())
    (mlrun,) = client.search_runs([client.get_experiment_by_name("observe-e2e").experiment_id])
    assert mlrun.data.params["loop.steps"] == "4" and mlrun.data.params["launch.trainer_ranks"] == "2"
    assert mlrun.data.metrics["summary/eval_reward_final"] == pytest.approx(summary["eval_reward_final"])
    assert len(client.get_metric_history(mlrun.info.run_id, "train/reward")) == 4
    (wandb_file,) = glob.glob(str(run / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    raw = Path(wandb_file).read_bytes()
    # the run file holds the config and the summary as JSON text inside its records
    assert b'"trainer_ranks":2' in raw.replace(b" ", b"") and b"eval_reward_final" in raw


def test_the_report_of_the_run_draws_in_chromium(run, tmp_path):
    assert main(["report", str(run / "run"), "--steps", "1,4"]) == 0
    page = run / "run" / "report.html"
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed: apt-get install -y chromium (README, Install)"
    r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                        f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=180, check=True)
    body = re.search(r"<body([^>]*)>", r.stdout).group(1)
    assert 'data-rendered="1"' in body and "data-errors" not in body
    for row in ("rank 0", "rank 1", "engine 0", "loop"):
        assert row in r.stdout
    assert "step 1" in r.stdout and "step 4" in r.stdout
