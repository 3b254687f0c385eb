"""The `conveyor` command end to end on the tiny model: bad input, resume, export."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conveyor.cli import main

pytestmark = pytest.mark.slow  # a whole training run or several: `pytest -m "not slow"` leaves it out

FAST = ["sft.steps=3", "sft.batch_size=8", "loop.batch_size=4", "rollout.n=4", "data.eval_size=16",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "loop.time_limit_s=null", "loop.eval_every=0", "observe.tensorboard=false"]


def _run(args):
    return subprocess.run([sys.executable, "-m", "conveyor.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args,needle", [
    (["train", "loop.stepz=3"], "loop.stepz: unknown field"),
    (["train", "nope.yaml"], "recipe nope.yaml does not exist"),
    (["train", "model.path=/does/not/exist"], "model.path '/does/not/exist' is not a Hugging Face checkpoint"),
    (["train", "data.source=jsonl", "data.path=/no/such.jsonl"], "/no/such.jsonl"),
    (["train", "reward.fn=nowhere.module:fn"], "cannot import module 'nowhere.module'"),
    (["train", "launch.placement=disaggregated", "launch.weight_sync=ipc"], "launch.weight_sync=ipc needs GPUs"),
    (["train", "launch.trainer_ranks=2", "launch.engines=3"],
     "launch.engines (3) must equal launch.trainer_ranks (2)"),
    (["train", "trainer.profile_steps=[-1]"], "trainer.profile_steps: Value error, steps are 0-based"),
])
def test_bad_input_is_one_line(tmp_path, args, needle):
    r = _run([*args, f"--output-dir={tmp_path / 'run'}", *FAST])
    assert r.returncode == 2, r.stderr[-2000:]
    err_lines = [l for l in r.stderr.splitlines() if l.startswith("conveyor: error:")]
    assert len(err_lines) == 1 and needle in err_lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def _weights(run_dir: Path):
    return load_file(str(run_dir / "final" / "model.safetensors"))


@pytest.mark.parametrize("launch", [
    [],
    # two FSDP2 ranks: sharded checkpoints, resumed and exported (whole-model ranks write the
    # single-device checkpoint: their resume is tests/unit/trainer/test_fsdp.py's)
    ["launch.placement=disaggregated", "launch.trainer_ranks=2", "launch.weight_sync=broadcast"],
], ids=["in-process", "fsdp2"])
def test_resume_matches_uninterrupted_run(tmp_path, launch):
    common = [*FAST, "loop.checkpoint_every=2", "observe.progress=false", *launch]
    full, part = tmp_path / "full", tmp_path / "part"
    # Profiling one step changes nothing else (the comparison below) and writes one trace per rank.
    assert main(["train", "loop.steps=4", f"--output-dir={full}", *common, "trainer.profile_steps=[1]"]) == 0
    ranks = 2 if "launch.trainer_ranks=2" in launch else 1
    assert sorted(p.name for p in (full / "profile").iterdir()) == sorted(
        f"trainer-step1-rank{r}.{ext}" for r in range(ranks) for ext in ("json", "txt"))
    assert "aten::" in (full / "profile" / "trainer-step1-rank0.txt").read_text()
    assert json.loads((full / "profile" / "trainer-step1-rank0.json").read_text())["traceEvents"]
    assert main(["train", "loop.steps=2", f"--output-dir={part}", *common]) == 0
    assert main(["train", "--resume", str(part), "loop.steps=4"]) == 0
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    s = json.loads((part / "summary.json").read_text())
    assert s["steps"] == 4
    assert {"eval_reward_initial", "eval_reward_warmstart", "eval_reward_final", "wall_seconds",
            "trained_samples_per_second"} <= s.keys()
    out = tmp_path / "exported"
    assert main(["export", str(part), str(out)]) == 0
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(m.state_dict()["lm_head.weight"], a["lm_head.weight"])
