"""The RL loop on a real two-node Ray cluster (loopback): same weights as the local launch, streaming
learns, a killed engine actor is replaced (the weight broadcast group re-forms) and the run
completes, or past ``launch.max_restarts`` stops the run with its name within seconds.

The cluster (``ray_cluster.RayCluster``) has a head node with the custom
resource ``node_a`` and a second node with ``node_b``; the runs pin the
trainer to node_a and the engine to node_b through
``launch.ray_trainer_resources`` / ``ray_engine_resources`` and the tests
check where each role ran (``ray_placement.json``). The cluster is the
session's (``conftest.py``): stopped at the end, and no process of it may be left.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conveyor.cli import main
from conveyor.config import DEFAULT_RECIPE

sys.path.insert(0, str(Path(__file__).parent))
from ray_cluster import RayCluster, wait_first_step

pytestmark = pytest.mark.slow  # whole training runs on a Ray cluster

# No-hang deadlines of the runs' waits: an actor starts in seconds idle, in minutes on a loaded machine
DEADLINES = ["launch.timeout_s=300", "launch.collective_timeout_s=300"]
TINY = ["loop.batch_size=4", "rollout.n=4", "data.eval_size=8", "model.tiny.hidden_size=32",
        "model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "loop.time_limit_s=null",
        "loop.eval_every=0", "observe.tensorboard=false", "observe.progress=false", *DEADLINES,
        "launch.placement=disaggregated"]


def on_ray(c: RayCluster, pinned: bool = True) -> list[str]:
    """The Ray launch on ``c``; ``pinned``: the trainer on node_a and the engine on node_b."""
    pins = ["launch.ray_trainer_resources={node_a: 0.1}", "launch.ray_engine_resources={node_b: 0.1}"]
    return ["launch.backend=ray", f"launch.ray_address={c.address}", *(pins if pinned else [])]


def placed(run_dir: Path) -> dict:
    return json.loads((run_dir / "ray_placement.json").read_text())


def assert_spread(run_dir: Path) -> None:
    p = placed(run_dir)
    assert set(p) == {"trainer0", "engine0"}
    assert "node_a" in p["trainer0"]["resources"] and "node_b" in p["engine0"]["resources"], p
    assert p["trainer0"]["node_id"] != p["engine0"]["node_id"], p


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank-pinned", "fsdp2-spread"])
def test_ray_launch_matches_the_local_launch_bit_for_bit(cluster, tmp_path, ranks):
    # Synchronous RL (staleness 0), a short warm start published to the engine, weights by broadcast.
    common = [*TINY, "loop.steps=3", "loop.max_staleness=0", "sft.steps=3", "sft.batch_size=8",
              "launch.weight_sync=broadcast", f"launch.trainer_ranks={ranks}"]
    local, remote = tmp_path / "local", tmp_path / "ray"
    assert main(["train", f"--output-dir={local}", *common]) == 0
    if ranks == 1:
        assert main(["train", f"--output-dir={remote}", *common, *on_ray(cluster)]) == 0
        assert_spread(remote)
    else:  # two FSDP ranks over gloo between actors on different nodes, the engine on either
        assert main(["train", f"--output-dir={remote}", *common, *on_ray(cluster, pinned=False),
                     "launch.ray_strategy=SPREAD"]) == 0
        p = placed(remote)
        assert set(p) == {"trainer0", "trainer1", "engine0"}
        assert p["trainer0"]["node_id"] != p["trainer1"]["node_id"], p
    a = load_file(str(local / "final" / "model.safetensors"))
    b = load_file(str(remote / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = [json.loads(line) for line in (remote / "metrics.jsonl").read_text().splitlines()]
    local_rows = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
    key = "reward"
    assert [r[key] for r in rows if key in r] == [r[key] for r in local_rows if key in r]


def _conformance_checks():
    """tests/unit/launch/test_handles_conform.py, loaded by path (pytest imports test files by importlib)."""
    import importlib.util
    path = Path(__file__).parents[1] / "unit" / "launch" / "test_handles_conform.py"
    spec = importlib.util.spec_from_file_location("handles_conform", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ray_handles_meet_their_protocols(cluster, tmp_path):
    import ray
    from transformers import AutoTokenizer

    from conveyor.config import load_config
    from conveyor.launch.ray import RayLauncher, connect
    from conveyor.run.session import resolve_model_path
    from conveyor.runtime import watchdog
    checks = _conformance_checks()
    cfg = load_config(None, [*checks.TINY, "launch.placement=disaggregated", *DEADLINES, *on_ray(cluster)])
    assert connect(cfg)
    launcher = engines = trainer = None
    try:
        path = resolve_model_path(cfg, tmp_path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        launcher = RayLauncher(cfg, tmp_path)
        engines = launcher.start_engines(path, tokenizer)
        trainer = launcher.start_trainer(path, tokenizer)
        launched = (launcher, engines, trainer, tokenizer)
        checks.test_the_launcher_and_its_handles_meet_their_protocols(launched)
        checks.test_a_published_step_reaches_the_chunk_admitted_for_it(launched)
        assert_spread(tmp_path)
        # A wait that runs out asks every role's actor where it was (runtime.watchdog).
        watchdog.configure(tmp_path / "logs")
        where = watchdog.dump_stacks("a look from the test")
        assert "engine0: " in where and "trainer0: " in where and "no stacks" not in where, where
        assert "in engine_loop" in (tmp_path / "logs" / "engine0.stacks.log").read_text()
        assert "Thread 0x" in (tmp_path / "logs" / "trainer0.stacks.log").read_text()
    finally:
        if trainer is not None:
            trainer.close()
        if engines is not None:
            launcher.stop_engines(engines.workers)
        if launcher is not None:
            launcher.close()
        ray.shutdown()


def test_streaming_on_ray_learns(cluster, tmp_path, default_run):
    # RL from the default run's warm start (the session's, shared with the learning tests): on seed 0
    # held-out greedy 0.552 and sampled 0.636 there, 0.994 and 0.991 after 25 synchronous steps.
    run = tmp_path / "run"
    args = ["loop.steps=20", "loop.max_staleness=1", f"model.path={default_run / 'warmstart'}", "sft.steps=0",
            "loop.eval_every=0", "data.eval_size=64", "observe.tensorboard=false", "observe.progress=false",
            "launch.placement=disaggregated", *DEADLINES]
    assert main(["train", str(DEFAULT_RECIPE), f"--output-dir={run}", *args, *on_ray(cluster)]) == 0
    assert_spread(run)
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 20
    # test_learning.py's margin: RL's gain from the warm start it started from
    assert s["eval_sampled_reward_final"] - s["eval_sampled_reward_initial"] >= 0.15, s
    assert s["eval_reward_final"] - s["eval_reward_initial"] >= 0.15, s
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stale = [r.get("staleness_mean", 0) for r in rows]
    assert max(stale) > 0, "streaming: some steps trained on samples of the previous version"


def test_killed_engine_actor_is_replaced_and_the_run_completes(cluster, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run}", *TINY,
                             "loop.steps=30", "loop.max_staleness=1", "sft.steps=0", *on_ray(cluster)],
                            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_first_step(proc, run)
        first = placed(run)["engine0"]
        os.kill(first["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=900)  # no-hang bound: about 90 s idle
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == list(range(1, 31))  # every step once: nothing lost or doubled
    assert rows[-1]["engine_restarts"] == 1, [r["engine_restarts"] for r in rows]
    assert "restarting it (1 of launch.max_restarts=3)" in err, err[-3000:]
    second = placed(run)["engine0"]  # the replacement, in the dead one's bundle (node_b)
    assert second["pid"] != first["pid"] and second["node_id"] == first["node_id"], (first, second)
    assert_spread(run)


def test_engine_actor_killed_while_starting_is_replaced_and_the_run_completes(cluster, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run}", *TINY,
                             "loop.steps=6", "sft.steps=0", *on_ray(cluster)],
                            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        # Killed as soon as it says where it runs: its engine is still being built (imports, model).
        while not ((run / "ray_placement.json").exists() and "engine0" in (run / "ray_placement.json").read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "engine0 never placed"
            time.sleep(0.01)
        first = placed(run)["engine0"]
        os.kill(first["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=900)  # no-hang bound
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "restarting it (1 of launch.max_restarts=3) while the engines start" in err, err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["engine_restarts"] == 1
    assert placed(run)["engine0"]["pid"] != first["pid"]


def test_killed_engine_actor_past_the_budget_stops_the_run_with_its_name(cluster, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run}", *TINY,
                             "loop.steps=100000", "loop.max_staleness=1", "sft.steps=0", "launch.max_restarts=0",
                             *on_ray(cluster)],
                            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_first_step(proc, run)
        engine = placed(run)["engine0"]
        os.kill(engine["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=110)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    lines = [l for l in err.splitlines() if l.startswith("conveyor: run stopped:")]
    assert lines, err[-3000:]
    line = lines[0]
    assert "engine 0 (Ray actor on node" in line and f"pid {engine['pid']}" in line, err[-3000:]
    assert "died" in line
    # A no-hang bound: the line above says the death stopped it; not launch.timeout_s (300 s).
    assert took < 100, f"the death took {took:.1f}s to stop the run"
    print(f"the run stopped {took:.1f}s after the engine actor was killed")


def test_a_placement_the_cluster_cannot_fit_is_one_line_at_once(cluster, tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={tmp_path / 'run'}", *TINY,
                        "loop.steps=1", "sft.steps=0", *on_ray(cluster, pinned=False),
                        "launch.ray_trainer_resources={node_c: 1}"],
                       env=cluster.env, capture_output=True, text=True, timeout=290, check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = [l for l in r.stderr.splitlines() if l.startswith("conveyor: error:")]
    assert "need node_c 1 (the cluster has 0)" in line and "add nodes" in line
    assert time.monotonic() - t0 < 250  # no-hang bound (about 18 s idle), short of launch.timeout_s (300 s)
