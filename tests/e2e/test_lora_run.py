"""LoRA runs end to end on the tiny model: adapter-only publishes reach the native engine in this
process and in an engine process (from one trainer or two FSDP2 ranks), the engine samples from
the trainer's adapted policy, and
`conveyor export` writes the merged model or the adapter alone, from final/ and from a checkpoint."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conveyor.cli import main

pytestmark = pytest.mark.slow  # whole training runs

FAST = ["sft.steps=0", "loop.steps=3", "loop.batch_size=4", "rollout.n=4", "data.eval_size=16",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "loop.time_limit_s=null", "loop.eval_every=0", "loop.checkpoint_every=3", "observe.tensorboard=false",
        "observe.progress=false", "trainer.mini_batches=1", "trainer.lr=0.05", "trainer.lora.enabled=true",
        "trainer.lora.rank=4", "trainer.lora.publish=adapter"]


@pytest.mark.parametrize("placement,ranks,parallel", [("colocated", 1, "auto"), ("disaggregated", 1, "auto"),
                                                     ("disaggregated", 2, "auto"), ("disaggregated", 2, "replicate")])
def test_adapter_publish_serves_the_trained_policy_and_exports(tmp_path, capsys, placement, ranks, parallel):
    """In this process, in an engine process, from 2 FSDP2 trainer ranks (what auto picks on CPU:
    sharded checkpoints) and from 2 whole-model ranks."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    assert main(["train", f"--output-dir={run}", f"launch.placement={placement}", f"launch.trainer_ranks={ranks}",
                 f"trainer.parallel={parallel}", *FAST]) == 0
    assert ((run / "checkpoints" / "step_000003" / "fsdp.json").is_file()) == (ranks > 1 and parallel == "auto")
    said = {"auto": "FSDP2, the model sharded over them (fsdp, chosen by trainer.parallel=auto)",
            "replicate": "the whole model on every rank (replicate)"}[parallel]
    assert (f"trainer: 2 ranks on cpu, {said}" if ranks > 1 else "trainer: one rank on cpu") in capsys.readouterr().err
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "ratio_max" in m]
    assert len(trained) == 3
    # Synchronous, one optimizer step per batch: the trainer recomputes the logprobs of the policy
    # the engine sampled from, so every ratio is 1 up to float32 rounding (docs: parity 1e-5). With
    # lr 0.05 an engine left on an older version would be far off from step 2 on.
    for m in trained:
        assert abs(m["ratio_max"] - 1) < 1e-3 and abs(m["ratio_mean"] - 1) < 1e-4, m

    # Exports: the adapter of final/ equals the one extracted from the last checkpoint, and the
    # merged model equals the base with that adapter applied by peft.
    assert main(["export", str(run), str(tmp_path / "a_final"), "--form", "adapter"]) == 0
    assert main(["export", str(run), str(tmp_path / "a_ckpt"), "--form", "adapter", "--checkpoint", "3"]) == 0
    assert main(["export", str(run), str(tmp_path / "m_ckpt"), "--checkpoint", "3"]) == 0
    a1 = load_file(tmp_path / "a_final" / "adapter_model.safetensors")
    a2 = load_file(tmp_path / "a_ckpt" / "adapter_model.safetensors")
    assert a1.keys() == a2.keys() and all(torch.equal(a1[k], a2[k]) for k in a1)
    assert any(float(t.abs().max()) > 0 for k, t in a1.items() if "lora_B" in k)  # it learned
    m_final = load_file(run / "final" / "model.safetensors")
    m_ckpt = load_file(tmp_path / "m_ckpt" / "model.safetensors")
    assert all(torch.equal(m_final[k], m_ckpt[k]) for k in m_final)
    ids = torch.randint(7, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m_ckpt", dtype=torch.float32)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(run / "base_model", dtype=torch.float32)
        before = base(input_ids=ids).logits
        via_peft = PeftModel.from_pretrained(base, tmp_path / "a_ckpt")(input_ids=ids).logits
    tol = 1e-4 * float(merged.abs().max())  # float32: W0 + BA merged vs applied as two products
    assert torch.allclose(via_peft, merged, rtol=0, atol=tol)
    assert not torch.allclose(before, merged, rtol=0, atol=tol)


def _cli(args):
    return subprocess.run([sys.executable, "-m", "conveyor.cli", *args], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.parametrize("args,needle", [
    (["trainer.lora.target_modules=[q_proj,qkv_proj]"],
     "trainer.lora.target_modules: ['qkv_proj'] not in the model; its linear layers are"),
    (["rollout.engine=remote", "rollout.remote_url=http://127.0.0.1:9", "trainer.lora.publish=adapter"],
     "trainer.lora.publish=adapter needs rollout.engine=native"),
])
def test_bad_lora_settings_stop_before_the_run(tmp_path, args, needle):
    r = _cli(["train", f"--output-dir={tmp_path / 'run'}", *FAST[:-1], *args])
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("conveyor: error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran


def test_export_adapter_of_a_full_run_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    r = _cli(["export", str(run), str(tmp_path / "out"), "--form", "adapter"])
    assert r.returncode == 2 and "has no LoRA adapter" in r.stderr, r.stderr[-2000:]
