"""Recipes that state their base, the difference from it, section descriptions and 'did you mean'."""
from pathlib import Path

import pytest
from pydantic import BaseModel

from conveyor.config import (DEFAULT_RECIPE, ConfigError, RunConfig, base_config, config_diff, describe_section,
                             load_config, sections)

ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_base_default_is_merged_under_the_recipe(tmp_path):
    r = _write(tmp_path / "r.yaml", "base: default\nname: mine\nloop: {steps: 7}\n")
    cfg, default = load_config(r), load_config(DEFAULT_RECIPE)
    assert cfg.loop.steps == 7 and cfg.name == "mine"
    # everything else is the default recipe's, deep-merged (loop.batch_size comes from it)
    assert cfg.loop.batch_size == default.loop.batch_size and cfg.sft.steps == default.sft.steps > 0
    label, base = base_config(r)
    assert label.startswith("default") and base == default
    assert [(k, new) for k, _, new in config_diff(cfg, base)] == [("name", "mine"), ("loop.steps", 7)]


def test_no_base_inherits_nothing_and_paths_are_relative_to_the_recipe(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "parent.yaml", "base: none\nsft: {steps: 5}\nloop: {steps: 9}\n")
    child = _write(tmp_path / "sub" / "child.yaml", "base: ../parent.yaml\nloop: {steps: 3}\n")
    cfg = load_config(child)
    assert (cfg.sft.steps, cfg.loop.steps, cfg.trainer.lr) == (5, 3, RunConfig().trainer.lr)
    label, base = base_config(child)
    assert label.endswith("parent.yaml") and base.loop.steps == 9
    assert [k for k, _, _ in config_diff(cfg, base)] == ["loop.steps"]
    alone = _write(tmp_path / "alone.yaml", "loop: {steps: 3}\n")
    assert load_config(alone).sft.steps == 0 and base_config(alone)[1] == RunConfig()


def test_replace_drops_what_the_base_has_under_a_key(tmp_path):
    _write(tmp_path / "parent.yaml", "base: none\ndata: {source: 'synthetic:addition', options: {digits: 2, "
                                     "teacher_error: 0.5}}\n")
    merged = _write(tmp_path / "merged.yaml", "base: parent.yaml\ndata: {options: {length: 5}}\n")
    replaced = _write(tmp_path / "replaced.yaml", "base: parent.yaml\ndata: {options: !replace {length: 5}}\n")
    emptied = _write(tmp_path / "emptied.yaml", "base: parent.yaml\ndata:\n  options: !replace {}\n")
    assert load_config(merged).data.options == {"digits": 2, "teacher_error": 0.5, "length": 5}
    assert load_config(replaced).data.options == {"length": 5}
    assert load_config(emptied).data.options == {} and load_config(emptied).data.source == "synthetic:addition"
    # a recipe based on the replacing one merges into the replaced mapping again
    grandchild = _write(tmp_path / "grandchild.yaml", "base: replaced.yaml\ndata: {options: {size: 3}}\n")
    assert load_config(grandchild).data.options == {"length": 5, "size": 3}
    bad = _write(tmp_path / "bad.yaml", "base: parent.yaml\nrollout: {stop: !replace [a]}\n")
    with pytest.raises(ConfigError, match=r"is malformed: .*!replace goes on a mapping"):
        load_config(bad)


@pytest.mark.parametrize("text,needle", [
    ("base: nowhere.yaml\n", "base 'nowhere.yaml' is not a recipe file"),
    ("base: self.yaml\n", "base chain loops back"),
    ("base: 3\n", "base must be 'default', 'none' or a recipe path"),
])
def test_bad_base_is_one_line(tmp_path, text, needle):
    r = _write(tmp_path / "self.yaml", text)
    with pytest.raises(ConfigError, match=needle):
        load_config(r)


def test_repo_recipes_state_their_base():
    vllm = load_config(ROOT / "recipes" / "vllm.yaml")
    gsm8k = load_config(ROOT / "recipes" / "gsm8k.yaml")
    assert vllm.data == gsm8k.data and vllm.trainer == gsm8k.trainer and vllm.rollout.engine == "vllm"
    assert base_config(ROOT / "recipes" / "vllm.yaml")[0].endswith("gsm8k.yaml")
    assert base_config(ROOT / "recipes" / "gsm8k.yaml")[0].startswith("none")


@pytest.mark.parametrize("overrides,needle", [
    (["loop.stepz=3"], "loop.stepz: unknown field (did you mean 'steps'?)"),
    (["trainr.lr=1"], "trainr: unknown field (did you mean 'trainer'?)"),
    (["rollout.temprature=1"], "did you mean 'temperature'?"),
    (["model.tiny.hiden_size=8"], "did you mean 'hidden_size'?"),
])
def test_misspelled_fields_suggest_the_right_one(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_misspelled_field_in_a_recipe_file(tmp_path):
    r = _write(tmp_path / "r.yaml", "base: default\nsft:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"sft.stpes: unknown field \(did you mean 'steps'\?\)"):
        load_config(r)


def _fields(model: type[BaseModel], prefix=""):
    for name, f in model.model_fields.items():
        yield prefix + name, f
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from _fields(f.annotation, f"{prefix}{name}.")


def test_every_field_has_a_description():
    missing = [k for k, f in _fields(RunConfig) if not f.description]
    assert missing == []


def test_describe_section_shows_value_default_and_description():
    cfg = load_config(None, ["trainer.lr=0.5"])
    text = describe_section(cfg, "trainer")
    assert text.splitlines()[0].startswith("[trainer] ")
    assert "  trainer.lr = 0.5   (default 1e-05)\n      AdamW learning rate of RL" in text
    assert "  trainer.device = auto\n" in text
    assert "model.tiny.hidden_size = 128" in describe_section(cfg, "model.tiny")
    assert set(sections()) == {"model", "data", "rollout", "reward", "trainer", "algo", "sft", "loop",
                               "env", "observe", "launch"}
    with pytest.raises(ConfigError, match=r"trainr is not a section of the config \(did you mean 'trainer'\?\)"):
        describe_section(cfg, "trainr")


def test_a_model_path_without_a_recipe_starts_from_the_pretrained_recipe():
    from conveyor.config import DEFAULT_RECIPE, PRETRAINED_RECIPE, load_config, recipe_without_file
    assert recipe_without_file([]) == DEFAULT_RECIPE
    assert recipe_without_file(["model.path=null", "loop.steps=3"]) == DEFAULT_RECIPE
    over = ["model.path=/models/mine", "data.source=jsonl"]
    assert recipe_without_file(over) == PRETRAINED_RECIPE
    cfg, tiny = load_config(PRETRAINED_RECIPE, over), load_config(DEFAULT_RECIPE)
    # None of the tiny model's tuned values reaches a real model.
    assert cfg.trainer.lr == 1e-6 < tiny.trainer.lr and cfg.trainer.mini_batches == 1
    assert cfg.sft.steps == 0 and cfg.data.chat_template and cfg.rollout.max_new_tokens == 256
    assert cfg.model.path == "/models/mine"


def test_cli_says_which_recipe_a_model_path_started_from(capsys):
    from conveyor.cli import main
    assert main(["config", "model.path=/models/mine", "--diff"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# base: none (pydantic defaults)") and "trainer.lr: 1.0e-06" in out
