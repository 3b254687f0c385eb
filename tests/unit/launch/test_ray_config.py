"""The Ray settings of reward workers: reward.executor=ray needs the Ray launcher, names what a
worker cannot rebuild, and a local Ray started for the run gets a CPU per reward worker."""
import pytest

from conveyor.config import ConfigError, load_config


def test_reward_actors_need_the_ray_launcher():
    with pytest.raises(ConfigError, match=r"reward.executor=ray .* needs launch.backend=ray; or use "
                                          r"reward.executor=process"):
        load_config(None, ["reward.executor=ray"])


def test_a_judge_cannot_run_in_reward_actors():
    with pytest.raises(ConfigError, match=r"reward.executor=ray: reward.fn=judge scores with an inference engine"):
        load_config(None, ["reward.executor=ray", "reward.fn=judge", "launch.backend=ray"])


def test_reward_actor_placement_fields():
    cfg = load_config(None, ["reward.executor=ray", "launch.backend=ray", "reward.workers=3",
                             "launch.ray_reward_resources={node_b: 0.1}", "launch.ray_reward_strategy=SPREAD"])
    assert cfg.launch.ray_reward_resources == {"node_b": 0.1} and cfg.launch.ray_reward_strategy == "SPREAD"
    with pytest.raises(ConfigError, match="ray_reward_strategy"):
        load_config(None, ["launch.ray_reward_strategy=SCATTER"])


@pytest.mark.parametrize("placement, executor, want", [
    ("disaggregated", "thread", 1 + 1), ("disaggregated", "ray", 1 + 1 + 3), ("colocated", "ray", 2 + 3),
    ("colocated", "process", 2)])
def test_a_local_ray_gets_a_cpu_per_reward_actor(placement, executor, want):
    # Imported here: Ray is imported only once the Ray tests set the cluster's RAY_AUTH_MODE.
    from conveyor.launch.ray import cpus_needed
    cfg = load_config(None, ["launch.backend=ray", f"launch.placement={placement}", f"reward.executor={executor}",
                             "reward.workers=3"])
    assert cpus_needed(cfg) == want


@pytest.mark.parametrize("address, needle", [
    ("127.0.0.1:{port}", "nothing answers there"),
    ("headnode", "give host:port"),
])
def test_a_wrong_ray_address_is_one_line_at_once(address, needle):
    # Before: Ray retried a dead address for about 14 minutes, then raised a raw ConnectionError.
    from conveyor.launch.placement import free_port
    from conveyor.launch.ray import connect
    from conveyor.runtime.errors import SetupError
    address = address.format(port=free_port())  # a port nothing listens on
    cfg = load_config(None, ["launch.backend=ray", f"launch.ray_address={address}"])
    with pytest.raises(SetupError, match=rf"launch.ray_address={address}: {needle}"):
        connect(cfg)
