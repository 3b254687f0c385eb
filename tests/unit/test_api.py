"""The Python API's pieces that need no run: prompt formatting, typed summaries, lazy import."""
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor import api
from conveyor.config import ConfigError, load_config
from conveyor.data.tiny import build_tokenizer


def test_generate_formats_prompts_as_the_runs_data():
    tok = build_tokenizer()
    cfg = load_config(None, ["data.source=jsonl", "data.prompt_template=Q: {prompt} A:", "data.chat_template=true",
                             "data.system_prompt=Be brief."])
    assert api.format_prompt(cfg, tok, "2+2?") == "<|system|>Be brief.\n<|user|>Q: 2+2? A:\n<|assistant|>"
    plain = load_config(None, ["data.source=jsonl", "data.prompt_template=Q: {prompt} A:"])
    assert api.format_prompt(plain, tok, "2+2?") == "Q: 2+2? A:"
    assert api.format_prompt(load_config(None, []), tok, "12+34=") == "12+34="  # synthetic: as given
    other = load_config(None, ["data.source=jsonl", "data.prompt_template={title}: {prompt}"])
    with pytest.raises(ConfigError, match=r"data.prompt_template names 'title' besides \{prompt\}; pass --raw"):
        api.format_prompt(other, tok, "x")


def test_summary_is_typed_from_summary_json():
    raw = {"steps": 3, "wall_seconds": 9.5, "eval_reward_initial": 0.1, "eval_reward_warmstart": 0.5,
           "eval_reward_final": 0.75, "eval_sampled_reward_final": 0.5, "eval_exact_final": 0.25,
           "eval_len_final": 4.0}
    s = api.summary_of(raw, Path("runs/x"))
    assert (s.steps, s.wall_seconds, s.model_dir) == (3, 9.5, Path("runs/x/final"))
    assert (s.initial.greedy_reward, s.warmstart.greedy_reward, s.final.greedy_reward) == (0.1, 0.5, 0.75)
    assert (s.final.sampled_reward, s.final.exact, s.initial.exact, s.initial.sampled_reward) == (0.5, 0.25, None,
                                                                                                  None)
    assert s.final.metrics == {"eval_reward": 0.75, "eval_sampled_reward": 0.5, "eval_exact": 0.25,
                               "eval_len": 4.0}


def test_model_dir_and_checkpoints_name_what_exists(tmp_path):
    with pytest.raises(ConfigError, match="no final/ model and no checkpoints/step_"):
        api.model_dir(tmp_path)
    (tmp_path / "checkpoints" / "step_000004" / "policy").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000004" / "extra.json").write_text('{"step": 4}')
    (tmp_path / "checkpoints" / "step_000006" / "policy").mkdir(parents=True)  # incomplete: no extra.json
    assert api.model_dir(tmp_path) == tmp_path / "checkpoints" / "step_000004"
    assert api.model_dir(tmp_path, 4) == api.model_dir(tmp_path, "latest") == tmp_path / "checkpoints/step_000004"
    with pytest.raises(ConfigError, match=r"--checkpoint 7: no checkpoint there; .* has step_000004"):
        api.model_dir(tmp_path, 7)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert api.model_dir(tmp_path) == tmp_path / "final"


def test_import_conveyor_stays_light():
    code = "import sys, conveyor; f = conveyor.load_config; print('torch' in sys.modules, f.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "conveyor.api"]


def test_a_resume_that_changes_the_model_data_or_algorithm_is_refused_naming_the_fields(tmp_path, capsys):
    import json

    from conveyor.api import check_resume
    from conveyor.cli import main
    from conveyor.config import ConfigError, load_config, save_config
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, ["loop.steps=4"]), run / "config.yaml")
    # The CLI: one line naming the field, before anything starts; the record is untouched.
    assert main(["train", "--resume", str(run), "model.tiny.hidden_size=64"]) == 2
    err = capsys.readouterr().err
    assert "model.tiny.hidden_size (128 -> 64) cannot change in a resumed run" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match=r"data.eval_size \(256 -> 50\) would make it another run; .* "
                                          r"--allow-changes"):
        check_resume(load_config(None, ["loop.steps=4", "data.eval_size=50"]), run)
    assert not (run / "config_changes.jsonl").exists()
    # Allowed: the loop's length always, the data with allow_changes; both recorded.
    assert check_resume(load_config(None, ["loop.steps=8"]), run) == [("loop.steps", 4, 8)]
    check_resume(load_config(None, ["loop.steps=4", "algo.loss=decoupled_ppo"]), run, allow_changes=True)
    records = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert [r["changes"] for r in records] == [{"loop.steps": {"from": 4, "to": 8}},
                                               {"algo.loss": {"from": "ppo", "to": "decoupled_ppo"}}]


def test_a_directory_that_holds_a_run_is_refused_unless_resumed(tmp_path, capsys):
    from conveyor.cli import main
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")  # an empty log: a run that wrote nothing yet is no run
    (run / "summary.json").write_text("{}")
    assert main(["train", f"--output-dir={run}", "loop.steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {run} holds another run (summary.json); give a new directory, or --resume {run}" in err
    assert "Traceback" not in err and (run / "summary.json").read_text() == "{}"
    with pytest.raises(ConfigError, match="holds another run"):
        api.train(load_config(None, ["loop.steps=1"]), run)
