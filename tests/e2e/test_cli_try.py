"""The CLI a new user meets, end to end on the tiny model: the run's output, generate, eval,
export of every kind of run directory, help and config, and the errors refused before start."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conveyor import api
from conveyor.cli import main

# two-digit addition (prompts of 4 to 6 characters, which the length tests below rely on)
FAST = ["data.source=synthetic:addition", "data.options={digits: 2}", "sft.steps=3", "sft.batch_size=8", "loop.batch_size=4", "rollout.n=4", "data.eval_size=16",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "loop.time_limit_s=null", "loop.eval_every=0", "observe.tensorboard=false"]
FSDP = ["launch.placement=disaggregated", "launch.trainer_ranks=2", "launch.weight_sync=broadcast"]

pytestmark = pytest.mark.slow  # short runs, but many: `pytest -m "not slow"` leaves them out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step run with a checkpoint at step 2, and what it printed."""
    out = tmp_path_factory.mktemp("cli") / "run"
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", *FAST, "loop.steps=2", "loop.checkpoint_every=2", f"--output-dir={out}"]) == 0
    return out, err.getvalue()


def test_train_prints_phases_summary_table_and_how_to_try(run):
    out, text = run
    s = json.loads((out / "summary.json").read_text())
    lines = text.splitlines()
    head = " ".join(l.strip() for l in lines[:lines.index(next(l for l in lines if l.startswith("eval @")))])
    assert head.startswith("recipe the built-in recipe (tiny model), base: none (pydantic defaults); ")
    assert " loop.steps=2," in head and " sft.steps=3," in head
    assert [l.split()[2] for l in lines if l.startswith("[RL]")] == ["1/2", "2/2"]
    row = next(l for l in lines if l.startswith("greedy reward"))
    assert row.split()[2:] == [f"{s[f'eval_reward_{p}']:.3f}" for p in ("initial", "warmstart", "final")]
    row = next(l for l in lines if l.startswith("exact answers"))
    assert row.split()[2:] == [f"{s[f'eval_exact_{p}']:.3f}" for p in ("initial", "warmstart", "final")]
    assert f"  conveyor eval {out}" in lines
    assert any(l.startswith(f"  conveyor generate {out} ") and l.endswith("=") for l in lines)
    assert any(l.startswith("  checkpoints/step_N/") for l in lines)
    assert not any("Loading weights" in l or l.startswith("INFO") for l in lines)


def test_generate_is_the_models_greedy_completion(run, capsys):
    out, _ = run
    from transformers import AutoModelForCausalLM, AutoTokenizer
    prompts = ["12+34=", "7+5="]
    assert main(["generate", str(out), *prompts, "--max-new-tokens=4"]) == 0
    got = capsys.readouterr().out.splitlines()
    tok = AutoTokenizer.from_pretrained(out / "final")
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    want = []
    for p in prompts:
        ids = tok(p, add_special_tokens=False, return_tensors="pt")["input_ids"]
        g = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
        want.append(tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True))
    assert got == [f"{p}\t{w}" for p, w in zip(prompts, want)]


def test_eval_reproduces_the_runs_final_numbers(run, capsys):
    out, _ = run
    s = json.loads((out / "summary.json").read_text())
    r = api.evaluate(out)
    assert (r.greedy_reward, r.exact) == (s["eval_reward_final"], s["eval_exact_final"])
    assert r.sampled_reward == pytest.approx(s["eval_sampled_reward_final"])
    assert main(["eval", str(out), "data.eval_size=16"]) == 0
    assert capsys.readouterr().out.startswith(f"greedy reward {s['eval_reward_final']:.3f}  sampled reward ")
    with_ckpt = api.evaluate(out, ["data.eval_size=8"], checkpoint=2)
    assert with_ckpt.greedy_reward is not None and with_ckpt.metrics["eval_reward"] == with_ckpt.greedy_reward


def _same(a: Path, b: Path) -> None:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


def test_samples_prints_what_the_model_wrote_at_a_step(run, capsys):
    out, _ = run
    from conveyor.observe.traces import read_traces
    recs = read_traces(out, step=2)
    assert 1 <= len(recs) <= 8 and {r["step"] for r in read_traces(out)} == {1, 2}
    capsys.readouterr()
    assert main(["samples", str(out), "--step", "2", "--n", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [line for line in lines if line.startswith("step 2 | ")]
    assert len(heads) == min(3, len(recs))
    assert f"reward {recs[0]['reward']:.3f}" in heads[0]  # the best first
    assert any(line.strip().startswith("completion: ") for line in lines)
    assert main(["samples", str(out), "--step", "99"]) == 2
    assert "no traces of step 99" in capsys.readouterr().err


def test_export_final_and_checkpoint(run, tmp_path):
    out, _ = run
    assert main(["export", str(out), str(tmp_path / "final")]) == 0
    _same(tmp_path / "final", out / "final")
    assert (tmp_path / "final" / "tokenizer.json").is_file()
    assert main(["export", str(out), str(tmp_path / "ckpt"), "--checkpoint", "2"]) == 0
    _same(tmp_path / "ckpt", out / "checkpoints" / "step_000002" / "policy")
    # a run with only final/ (no checkpoints): what `conveyor train` writes by default
    only_final = tmp_path / "only_final"
    (only_final / "final").mkdir(parents=True)
    for f in (out / "final").iterdir():
        (only_final / "final" / f.name).write_bytes(f.read_bytes())
    assert main(["export", str(only_final), str(tmp_path / "of")]) == 0
    _same(tmp_path / "of", out / "final")


def test_export_sharded_fsdp_checkpoint(tmp_path):
    out = tmp_path / "fsdp"
    assert main(["train", *FAST, *FSDP, "loop.steps=2", "loop.checkpoint_every=2", "observe.progress=false",
                 f"--output-dir={out}"]) == 0
    ckpt = out / "checkpoints" / "step_000002"
    assert (ckpt / "fsdp.json").is_file() and not (ckpt / "policy" / "model.safetensors").exists()
    assert main(["export", str(out), str(tmp_path / "exp"), "--checkpoint", "latest"]) == 0
    _same(tmp_path / "exp", out / "final")  # the checkpoint at the last step holds the final weights
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(["dcp", "extra.json", "fsdp.json", "policy", "rng",
                                                             "training_state.pt"])  # left as it was
    assert main(["generate", str(out), "1+2=", "--checkpoint", "2"]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
@pytest.mark.parametrize("args,needle", [
    (["rollout.device=cuda"], "rollout.device=cuda but this machine has no usable CUDA GPU"),
    (["trainer.device=cuda"], "trainer.device=cuda but this machine has no usable CUDA GPU"),
    ([*FSDP, "trainer.device=cuda"], "trainer.device=cuda but this machine has no usable CUDA GPU"),
    (["launch.placement=disaggregated", "rollout.device=cuda:1"], "set rollout.device=auto or rollout.device=cpu"),
])
def test_cuda_on_a_machine_without_gpus_is_refused_before_start(tmp_path, capsys, args, needle):
    assert main(["train", *FAST, *args, f"--output-dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("conveyor: error: ") and needle in err[-1]
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_held_out_set_with_nothing_left_is_an_error(tmp_path, capsys):
    # a context of 4 tokens leaves 3 for a prompt; the shortest prompt ("1+2=") has 4
    rc = main(["train", *FAST, "model.tiny.max_position_embeddings=4", "rollout.max_new_tokens=1",
               f"--output-dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[-1].startswith("conveyor: error: all 16 held-out prompts are longer than the "
                                          "model's context (3 prompt tokens)")
    assert "model.tiny.max_position_embeddings" in err[-1]


def test_skipped_warm_start_names_the_model_rl_starts_from(tmp_path, capsys):
    from conveyor.data.tiny import build_tiny
    model = build_tiny(tmp_path / "model", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64)
    assert main(["train", *FAST, "sft.steps=0", "loop.steps=1", f"model.path={model}",
                 f"--output-dir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"warm-start: skipped (sft.steps is 0); RL starts from {model} as it is" in err
    assert "trainer: one rank on cpu" in err


def test_skipped_warm_start_and_prompts_skipped_for_length_are_said(tmp_path, capsys):
    # a context of 6 tokens: prompts of 6 characters ("12+34=") are skipped, shorter ones kept
    assert main(["train", *FAST, "sft.steps=0", "loop.steps=1", "model.tiny.max_position_embeddings=6",
                 "rollout.max_new_tokens=1", f"--output-dir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(l.startswith("warm-start: skipped (sft.steps is 0); RL starts from the untrained tiny model") for l in err)
    notes = [l for l in err if "held-out prompts skipped" in l]
    assert len(notes) == 1 and notes[0].startswith("note: 12 of 16 held-out prompts skipped: longer than the "
                                                   "model's context (5 prompt tokens)")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_prompt_too_long_final"] == 12 and summary["final_metrics"]["prompt_too_long"] > 0
    assert any(l.startswith("note: ") and "training prompts were skipped: longer than the model's context "
               "(5 prompt tokens)" in l for l in err)


def test_help_lists_commands_override_syntax_and_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    text = capsys.readouterr().out
    assert e.value.code == 0
    for needle in ("train", "generate", "eval", "export", "config", "section.field=value", "examples:",
                   "conveyor config trainer", "built-in recipe: "):
        assert needle in text, needle
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--temperature" in capsys.readouterr().out


def test_config_section_and_diff(tmp_path, capsys):
    assert main(["config", "sft", "sft.steps=9"]) == 0
    text = capsys.readouterr().out
    assert "  sft.steps = 9   (default 0)\n      most warm-start steps; 0 skips the warm-start" in text
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: default\nloop: {steps: 5}\n")
    assert main(["config", str(recipe), "--diff", "trainer.lr=0.1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "# base: default (the built-in recipe); 2 fields differ",
        "trainer.lr: 0.1   # base: 0.0003", "loop.steps: 5   # base: 150"]
    assert main(["config", "trainr"]) == 2
    assert "(did you mean 'trainer'?)" in capsys.readouterr().err


def test_example_custom_reward_through_the_python_api(tmp_path, monkeypatch, capsys):
    import importlib.util
    here = Path(__file__).resolve().parents[2] / "examples" / "custom_reward"
    monkeypatch.syspath_prepend(str(here))  # run.py adds it too; this undoes it after the test
    spec = importlib.util.spec_from_file_location("custom_reward_run", here / "run.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["loop.steps=2", "sft.steps=20", "data.eval_size=20", "model.tiny.hidden_size=32",
                            "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
                            "observe.tensorboard=false", f"--output-dir={tmp_path / 'shout'}"])
    assert isinstance(summary, api.TrainSummary) and summary.steps == 2
    raw = json.loads((tmp_path / "shout" / "summary.json").read_text())
    assert summary.final.greedy_reward == raw["eval_reward_final"]
    assert summary.warmstart.exact == raw["eval_exact_warmstart"]  # reward.py's own "exact" metric
    assert summary.model_dir == tmp_path / "shout" / "final" and summary.model_dir.is_dir()
    assert capsys.readouterr().out.splitlines()[-1].startswith("up cat= -> ")
    sys.modules.pop("reward", None)  # examples/custom_reward/reward.py, imported by name
