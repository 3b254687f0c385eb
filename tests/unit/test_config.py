import pytest

from conveyor.cli import DEFAULT_RECIPE
from conveyor.config import ConfigError, RunConfig, load_config, save_config


def test_default_recipe_loads_and_overrides_apply():
    cfg = load_config(DEFAULT_RECIPE, ["rollout.n=4", "algo.loss=gspo", "data.options.digits=3",
                                       "trainer.max_grad_norm=null"])
    assert cfg.rollout.n == 4 and cfg.algo.loss == "gspo"
    assert cfg.data.options["digits"] == 3 and cfg.trainer.max_grad_norm is None


def test_unknown_key_names_the_dotted_field():
    with pytest.raises(ConfigError, match=r"rollout\.temprature: unknown field"):
        load_config(None, ["rollout.temprature=0.5"])


def test_wrong_type_names_field_and_expectation():
    with pytest.raises(ConfigError, match=r"loop\.steps: Input should be a valid integer.*abc"):
        load_config(None, ["loop.steps=abc"])
    with pytest.raises(ConfigError, match=r"algo\.loss: Input should be 'auto', 'ppo', 'gspo' or 'decoupled_ppo'"):
        load_config(None, ["algo.loss=ppo2"])
    with pytest.raises(ConfigError, match=r"rollout\.n: Input should be greater than or equal to 1"):
        load_config(None, ["rollout.n=0"])


def test_malformed_and_missing_recipe(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("loop: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="must look like"):
        load_config(None, ["loop.steps"])


def test_toml_recipe_and_saved_config_round_trip(tmp_path):
    t = tmp_path / "r.toml"
    t.write_text('name = "x"\n[loop]\nsteps = 7\n[rollout]\nstop = ["\\n"]\n')
    cfg = load_config(t)
    assert cfg.name == "x" and cfg.loop.steps == 7 and cfg.rollout.stop == ["\n"]
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg and isinstance(again, RunConfig)


def test_impossible_combinations_fail_at_load():
    with pytest.raises(ConfigError, match=r"loop\.max_staleness: Input should be greater than or equal to 0"):
        load_config(None, ["loop.max_staleness=-1"])
    with pytest.raises(ConfigError, match=r"loop.concurrency \(99\) exceeds"):
        load_config(None, ["loop.concurrency=99", "loop.batch_size=4", "loop.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"loop.buffer_size \(2\) must hold one batch"):
        load_config(None, ["loop.buffer_size=2", "loop.batch_size=4"])
    with pytest.raises(ConfigError, match=r"launch\.engines: Input should be greater than or equal to 1"):
        load_config(None, ["launch.engines=0"])
    with pytest.raises(ConfigError, match="launch.placement=disaggregated"):
        load_config(None, ["launch.engines=2"])
    with pytest.raises(ConfigError, match="trainer.reference"):
        load_config(None, ["algo.kl_coef=0.1"])
    with pytest.raises(ConfigError, match="trainer.critic"):
        load_config(None, ["algo.advantage=gae"])


def test_auto_loss_corrects_for_staleness_only_when_there_is_some():
    assert load_config(None, []).algo.loss == "ppo"
    assert load_config(None, ["loop.max_staleness=2"]).algo.loss == "decoupled_ppo"
    assert load_config(None, ["loop.max_staleness=2", "algo.loss=ppo"]).algo.loss == "ppo"
    assert load_config(None, ["algo.loss=gspo"]).algo.loss == "gspo"
    # What `conveyor train loop.max_staleness=2` runs: the recipe must not pin plain PPO.
    assert load_config(DEFAULT_RECIPE, ["loop.max_staleness=2"]).algo.loss == "decoupled_ppo"
    assert load_config(DEFAULT_RECIPE, []).algo.loss == "ppo"
