"""Reward workers as Ray actors (``reward.executor=ray``) on the two-node loopback cluster: they run
where their bundles put them, score as the process workers do, and a call past its deadline, a dead
actor and too many deaths in a row are handled by the process executor's rules; a whole run scored
by actors on the second node survives one of them being killed, and counts it.

The cluster is the session's (``conftest.py``); the actors import the test rewards from
``tests/unit/reward/worker_rewards.py`` (``ray_cluster`` puts the repository root on their path).
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

from conveyor.runtime.errors import RoleError
from conveyor.types import Task, Trajectory

sys.path.insert(0, str(Path(__file__).parent))
from ray_cluster import wait_first_step  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster, and a whole training run

W = "tests.unit.reward.worker_rewards:"
ON_B = {"node_b": 0.1}


@pytest.fixture
def ray_driver(cluster):
    import ray
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def traj(i: int, text: str = "ok") -> Trajectory:
    return Trajectory(Task(f"t{i}", "q", "42"), (1,), (5,), (-0.5,), (0,), (1,), text=text)


def service(fn: str, kwargs: dict | None = None, resources: dict | None = None, strategy: str = "PACK",
            placement_timeout_s: float = 60.0, **kw):
    from conveyor.launch.ray_rewards import RayRewardService, RewardPlacement
    from conveyor.reward.factory import RewardSpec
    return RayRewardService(RewardSpec(W + fn, kwargs or {}),
                            RewardPlacement(resources or {}, strategy, placement_timeout_s), **kw)


def node_with(ray, resource: str) -> str:
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


def test_reward_actors_score_on_the_node_their_bundles_name(ray_driver):
    with service("length", {"sleep_s": 0.2}, ON_B, workers=2, timeout_s=20.0) as svc:
        out = svc.score([traj(i, "x" * i) for i in range(6)])
        assert [t.reward for t in out] == [float(i) for i in range(6)]
        pids = {t.reward_info["pid"] for t in out}
        assert len(pids) == 2 and os.getpid() not in pids  # two actors shared the work
        places = svc.places()
        assert {p.node_id for p in places.values()} == {node_with(ray_driver, "node_b")}
        assert {p.pid for p in places.values()} == pids
        assert svc.stats() == {"scored": 6, "failures": 0, "timeouts": 0, "nonfinite": 0,
                               "worker_deaths": 0, "restarts": 0}


def test_spread_puts_the_reward_actors_on_both_nodes(ray_driver):
    with service("length", workers=2, strategy="STRICT_SPREAD") as svc:
        svc.score([traj(0), traj(1)])
        assert len({p.node_id for p in svc.places().values()}) == 2


def test_a_call_past_its_deadline_kills_the_actor_and_gives_the_fallback(ray_driver, tmp_path):
    pidfile = tmp_path / "hung.pid"
    with service("hang_on", {"pidfile": str(pidfile)}, ON_B, workers=2, timeout_s=1.5, fallback=-0.5) as svc:
        t0 = time.monotonic()
        out = svc.score([traj(0, "hang"), traj(1), traj(2)])
        assert 1.5 <= time.monotonic() - t0 < 60.0  # no-hang bound: its deadline (counted below), not the hang
        assert [t.reward for t in out] == [-0.5, 1.0, 1.0]
        assert out[0].reward_info == {"reward_error": "timeout"}
        stats = svc.stats()
        assert stats["timeouts"] == 1 and stats["restarts"] == 1 and stats["worker_deaths"] == 0
        hung = int(pidfile.read_text())
        assert _gone_within(hung, 15.0), "the hung actor's process was not killed"
        assert [t.reward for t in svc.score([traj(3), traj(4)])] == [1.0, 1.0]  # the replacement scores


def test_a_dead_actor_is_replaced_and_its_trajectory_scored_once_more(ray_driver, tmp_path):
    marker = tmp_path / "dead.pid"
    with service("die_once", {"marker": str(marker), "how": "kill"}, ON_B, workers=2, timeout_s=30.0) as svc:
        out = svc.score([traj(0, "die"), traj(1)])
        dead = int(marker.read_text())
        assert out[0].reward not in (0.0, float(dead)) and out[0].reward_info == {}  # rescored by a live actor
        stats = svc.stats()
        assert stats["worker_deaths"] == 1 and stats["restarts"] == 1 and stats["failures"] == 0


def test_deaths_in_a_row_past_max_restarts_stop_naming_the_reward(ray_driver):
    with service("kill_on", {}, ON_B, workers=1, timeout_s=30.0, max_restarts=1) as svc:
        future = svc.submit(traj(0, "kill"))
        with pytest.raises(RoleError, match=r"reward 'kill_on': 2 worker processes died in a row .*"
                                            r"reward.max_restarts=1\); the last \(a Ray actor\) died on node "
                                            r"\S+ .*pid \d+: ActorDiedError"):
            future.result(timeout=120)
        with pytest.raises(RoleError):  # and every later call
            svc.submit(traj(1)).result(timeout=10)


def live_groups(ray) -> list:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_a_reward_that_cannot_load_is_one_line_and_leaves_no_group(ray_driver):
    from conveyor.launch.ray_rewards import RayRewardService, RewardPlacement
    from conveyor.plugins import PluginError
    from conveyor.reward.factory import RewardSpec
    with pytest.raises(PluginError, match=r"reward 'nowhere.module:fn' cannot be loaded in a reward worker "
                                          r"process: .*cannot import module 'nowhere.module'"):
        RayRewardService(RewardSpec("nowhere.module:fn"), RewardPlacement(ON_B, "PACK", 60.0), workers=1)
    assert live_groups(ray_driver) == []


def test_bundles_the_cluster_cannot_place_are_one_line(ray_driver):
    from conveyor.plugins import PluginError
    t0 = time.monotonic()
    with pytest.raises(PluginError, match=r"could not place the reward workers' bundles .*node_c.* within 3s"):
        service("length", resources={"node_c": 1}, workers=1, placement_timeout_s=3.0)
    assert time.monotonic() - t0 < 60  # no-hang bound: its 3 s deadline (named above) and the group's removal
    assert live_groups(ray_driver) == []


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def reward_actor_pids(cluster) -> dict[int, str]:
    """pid -> which node's temp dir its raylet names (a, b), for this cluster's reward actors."""
    table = {}
    for pid in cluster.processes():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd.startswith("ray::RewardActor"):
            session = [e.decode(errors="replace") for e in env if e.startswith(b"RAY_RAYLET_PID=")]
            table[pid] = session[0] if session else "?"
    return table


def test_a_run_scored_by_reward_actors_on_node_b_survives_a_killed_one(cluster, tmp_path):
    run = tmp_path / "run"
    args = ["loop.batch_size=4", "rollout.n=4", "data.eval_size=8", "model.tiny.hidden_size=32",
            "model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "loop.time_limit_s=null",
            "loop.eval_every=0", "observe.tensorboard=false", "observe.progress=false", "launch.timeout_s=300",
            "launch.placement=disaggregated", "loop.steps=25", "loop.max_staleness=1", "sft.steps=0",
            "launch.backend=ray", f"launch.ray_address={cluster.address}",
            "launch.ray_trainer_resources={node_a: 0.1}", "launch.ray_engine_resources={node_b: 0.1}",
            "reward.executor=ray", "reward.workers=2", "launch.ray_reward_resources={node_b: 0.1}"]
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run}", *args],
                            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_first_step(proc, run)
        actors = reward_actor_pids(cluster)
        assert len(actors) == 2, actors
        engine = json.loads((run / "ray_placement.json").read_text())["engine0"]
        raylet_b = _raylet_of(engine["pid"])
        assert {raylet for raylet in actors.values()} == {raylet_b}, "the reward actors are not on node_b"
        os.kill(min(actors), signal.SIGKILL)
        _, err = proc.communicate(timeout=900)  # no-hang bound
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train[-1]["step"] == 25
    last = train[-1]
    assert last["reward_worker_deaths"] == 1 and last["reward_restarts"] == 1, last
    assert last["reward_failures"] == 0, last  # its trajectory (if it held one) was scored once more


def _raylet_of(pid: int) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (raylet,) = [e.decode() for e in env if e.startswith(b"RAY_RAYLET_PID=")]
    return raylet
