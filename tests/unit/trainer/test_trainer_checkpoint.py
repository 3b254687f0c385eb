import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor.config import TrainerConfig
from conveyor.trainer.checkpoint import export_hf
from conveyor.trainer.single import LocalTrainer

CFG = dict(device="cpu", lr=1e-3, warmup_steps=1, lr_schedule="linear", critic=True, critic_lr=1e-3,
           micro_batch_tokens=16)


def weights(trainer):
    state = {f"policy.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    state.update({f"critic.{k}": v.clone() for k, v in trainer.critic.state_dict().items()})
    return state


def test_resume_reproduces_training_exactly(tiny_dir, make_batch, pg_value_loss, tmp_path):
    batches = [make_batch([6, 9, 4, 7], seed=s) for s in range(3)]
    first = LocalTrainer(tiny_dir, TrainerConfig(**CFG), total_steps=5)
    for b in batches[:2]:
        first.train(b, pg_value_loss)
    first.save(tmp_path / "ckpt", extra={"cursor": 8, "step": 2})
    after_save = (random.random(), torch.rand(3))
    m_first = first.train(batches[2], pg_value_loss)
    expected = weights(first)

    second = LocalTrainer(tiny_dir, TrainerConfig(**CFG), total_steps=5)
    assert second.load(tmp_path / "ckpt") == {"cursor": 8, "step": 2}
    assert second.step == 2
    assert (random.random(), torch.rand(3).tolist()) == (after_save[0], after_save[1].tolist())
    m_second = second.train(batches[2], pg_value_loss)
    assert m_second["lr"] == m_first["lr"] == pytest.approx(1e-3 * 0.75)  # linear: 1 - (2 - 1) / (5 - 1)
    assert m_second["loss"] == m_first["loss"]
    got = weights(second)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert second.step == first.step == 3


def test_checkpoint_layout_and_export(tiny_dir, make_batch, pg_value_loss, tmp_path):
    trainer = LocalTrainer(tiny_dir, TrainerConfig(**CFG), total_steps=5)
    trainer.train(make_batch([5, 8]), pg_value_loss)
    ckpt = tmp_path / "ckpt"
    trainer.save(ckpt, extra={"step": 1})
    trainer.save(ckpt, extra={"step": 1, "again": True})  # overwriting an existing checkpoint works
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt"]  # no temporary or backup directory is left behind
    assert {"critic.safetensors", "training_state.pt", "rng.pt", "extra.json", "policy"} <= {
        p.name for p in ckpt.iterdir()}
    assert json.loads((ckpt / "extra.json").read_text()) == {"again": True, "step": 1}

    out = export_hf(ckpt, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out)
    own = trainer.model.state_dict()
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("12+3=")["input_ids"]) == "12+3="

    trainer.export_hf(tmp_path / "direct")
    assert (tmp_path / "direct" / "tokenizer.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "direct")
    assert all(torch.equal(v, own[k]) for k, v in again.state_dict().items())


def test_load_errors_name_the_problem(tiny_dir, tmp_path):
    plain = LocalTrainer(tiny_dir, TrainerConfig(device="cpu"), total_steps=1)
    with_critic = LocalTrainer(tiny_dir, TrainerConfig(device="cpu", critic=True), total_steps=1)
    with pytest.raises(FileNotFoundError, match="is not a conveyor checkpoint"):
        plain.load(tmp_path)
    plain.save(tmp_path / "plain", extra={})
    with_critic.save(tmp_path / "critic", extra={})
    with pytest.raises(FileNotFoundError, match="critic.safetensors is missing"):
        with_critic.load(tmp_path / "plain")
    with pytest.raises(ValueError, match="set trainer.critic=true"):
        plain.load(tmp_path / "critic")
    with pytest.raises(TypeError, match="JSON-serialisable"):
        plain.save(tmp_path / "bad", extra={"t": torch.zeros(1)})
    assert not (tmp_path / "bad").exists()


def test_async_checkpoint_holds_the_state_of_its_call_while_training_goes_on(tiny_dir, make_batch, pg_loss,
                                                                            tmp_path):
    cfg = TrainerConfig(**{**CFG, "critic": False, "async_checkpoint": True})
    batches = [make_batch([6, 9, 4, 7], seed=s) for s in range(3)]
    first = LocalTrainer(tiny_dir, cfg, total_steps=5)
    first.train(batches[0], pg_loss)
    at_save = {k: v.clone() for k, v in first.model.state_dict().items()}
    first.save(tmp_path / "ckpt", extra={"step": 1}, wait=False)
    m_first = first.train(batches[1], pg_loss)  # the optimizer steps while the files are written
    first.wait_saved()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # renamed into place
    second = LocalTrainer(tiny_dir, cfg, total_steps=5)
    assert second.load(tmp_path / "ckpt") == {"step": 1}
    got = second.model.state_dict()
    assert all(torch.equal(got[k], at_save[k]) for k in at_save)  # the weights of the call, not later ones
    assert second.model.lm_head.weight is not None
    m_second = second.train(batches[1], pg_loss)
    assert m_second["loss"] == m_first["loss"]
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))
