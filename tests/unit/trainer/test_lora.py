"""LoRA on the single-device trainer and the native engine: only adapters learn, both publish
forms serve the same weights, versions replace each other's delta, exports reload."""
from __future__ import annotations

import pytest
import torch

from conveyor.config import RunConfig, TrainerConfig
from conveyor.config.lora import LoraConfig
from conveyor.rollout.native.engine import NativeEngine
from conveyor.trainer import lora
from conveyor.trainer.single import LocalTrainer

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def lora_cfg(publish: str = "merged", **kw) -> TrainerConfig:
    return TrainerConfig(device="cpu", lr=5e-2, max_grad_norm=None,
                         lora=LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=TARGETS, publish=publish),
                         **kw)


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_only_adapters_train_and_base_stays_bit_identical(make_model, make_batch, pg_loss):
    model = make_model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    tr = LocalTrainer(model, lora_cfg(), total_steps=3)
    opt_params = [p for g in tr.optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in tr.model.named_parameters()}
    assert opt_params and all(lora.is_adapter(names[id(p)]) for p in opt_params)
    assert len(opt_params) == 2 * 2 * len(TARGETS)  # A and B per target per layer (2 layers)
    start = {n: t.clone() for n, t in tr.model.state_dict().items() if lora.is_adapter(n)}
    for seed in range(2):
        tr.train(make_batch([9, 12, 7], seed=seed), pg_loss)
    after = tr.model.state_dict()
    assert all(not torch.equal(after[n], t) for n, t in start.items() if n.endswith(lora.PEFT_B))  # they learned
    for name, t in after.items():
        if not lora.is_adapter(name):
            assert torch.equal(t, before[name.replace(lora.PEFT_BASE, ".")]), name  # bit-identical base


def test_merged_publish_is_the_base_model_before_training(make_model):
    tr = LocalTrainer(make_model(), lora_cfg(), total_steps=1)
    plain = make_model().state_dict()
    got = dict(tr.named_weights())
    assert set(got) == set(plain)
    for n, t in got.items():
        assert torch.equal(t, plain[n]), n  # B = 0: W0 + 0 exactly


def _engine(make_model, tokenizer):
    return NativeEngine(make_model(), tokenizer, device="cpu", dtype="float32")


def test_adapter_publish_equals_merged_publish_over_versions(make_model, make_batch, pg_loss, tokenizer):
    """Engine A takes merged weights, engine B only adapters, three versions in a row: the same
    weights each time (float32 rounding of one addmm); B's weights are W0 + the newest delta."""
    merged_tr = LocalTrainer(make_model(), lora_cfg("merged"), total_steps=4)
    adapter_tr = LocalTrainer(make_model(), lora_cfg("adapter"), total_steps=4)
    eng_m, eng_a = _engine(make_model, tokenizer), _engine(make_model, tokenizer)
    w0 = params_of(eng_a.model)
    sent = []
    for version in range(1, 4):
        batch = make_batch([9, 12, 7], seed=version)
        merged_tr.train(batch, pg_loss)
        adapter_tr.train(batch, pg_loss)
        eng_m.update_weights(merged_tr.named_weights(), version)
        sent = list(adapter_tr.named_weights())
        assert sent and all(n.endswith((".lora_A", ".lora_B")) for n, _ in sent)
        eng_a.update_weights(sent, version)
        assert eng_a.version == eng_m.version == version
        m, a = params_of(eng_m.model), params_of(eng_a.model)
        for name in m:
            # Same float32 inputs and the same addmm on both sides; allow a few ulps of the weight.
            tol = 4 * torch.finfo(torch.float32).eps * float(m[name].abs().max())
            assert torch.allclose(a[name], m[name], rtol=0, atol=tol), (version, name)
    # The delta of the last version alone sits on top of W0: nothing piled up.
    adapters = dict(sent)
    for key, t in adapters.items():
        if key.endswith(".lora_A"):
            module = key[: -len(".lora_A")]
            want = w0[module + ".weight"] + adapters[module + ".lora_B"] @ t
            got = params_of(eng_a.model)[module + ".weight"]
            tol = 4 * torch.finfo(torch.float32).eps * float(want.abs().max())
            assert torch.allclose(got, want, rtol=0, atol=tol), module
            assert not torch.allclose(got, w0[module + ".weight"])  # it did move


def test_bad_adapter_update_changes_nothing(make_model, tokenizer):
    eng = _engine(make_model, tokenizer)
    before, version = params_of(eng.model), eng.version
    a = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="both"):
        eng.update_weights([("model.layers.0.self_attn.q_proj.lora_A", a)], 1)
    with pytest.raises(ValueError, match="do not make"):
        eng.update_weights([("model.layers.0.self_attn.q_proj.lora_A", a),
                            ("model.layers.0.self_attn.q_proj.lora_B", torch.ones(7, 4))], 1)
    assert eng.version == version
    assert all(torch.equal(p, before[n]) for n, p in params_of(eng.model).items())


def test_missing_targets_are_named_with_the_models_layers(make_model):
    cfg = LoraConfig(enabled=True, target_modules=["q_proj", "qkv", "fc1"])
    with pytest.raises(lora.LoraSetupError) as e:
        lora.attach(make_model(), cfg)
    msg = str(e.value)
    assert "['qkv', 'fc1']" in msg and "q_proj" in msg and "down_proj" in msg and "\n" not in msg


def test_adapter_publish_refused_for_engines_that_take_full_weights():
    with pytest.raises(ValueError, match="trainer.lora.publish=adapter needs rollout.engine=native"):
        RunConfig.model_validate({"rollout": {"engine": "vllm"},
                                  "trainer": {"lora": {"enabled": True, "publish": "adapter"}}})
    RunConfig.model_validate({"rollout": {"engine": "vllm"}, "trainer": {"lora": {"enabled": True}}})  # merged: fine


def test_export_merged_and_adapter_reload(make_model, make_batch, pg_loss, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tr = LocalTrainer(make_model(), lora_cfg(), total_steps=2)
    tr.train(make_batch([9, 12, 7]), pg_loss)
    tr.export_hf(tmp_path / "out")
    ids = torch.randint(7, 60, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = tr.model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
        got = merged(input_ids=ids).logits
        peft = PeftModel.from_pretrained(make_model(), tmp_path / "out" / lora.ADAPTER_DIR)
        via_peft = peft(input_ids=ids).logits
    tol = 1e-4 * float(want.abs().max())  # float32: merged vs factored products differ by rounding only
    assert torch.allclose(got, want, rtol=0, atol=tol)
    assert torch.allclose(via_peft, want, rtol=0, atol=tol)
    assert not torch.allclose(got, make_model()(input_ids=ids).logits.detach(), rtol=0, atol=tol)  # it learned


def test_fused_gpu_forwards_leave_adapted_blocks_to_peft(make_model):
    """The trainer's fused attention and MLP forwards read the projections' weights directly; a
    block whose projections carry adapters keeps its own forward, or the adapters would be skipped."""
    from conveyor.trainer.kernels.layers import use_fused_layers

    plain = make_model()
    assert use_fused_layers(plain) == 2 * 4 + 1  # per layer: 2 norms, the MLP, attention; the final norm
    adapted = lora.attach(make_model(), LoraConfig(enabled=True, target_modules=["q_proj", "up_proj"]))
    use_fused_layers(adapted)
    for layer in adapted.model.layers:
        assert "forward" not in vars(layer.self_attn) and "forward" not in vars(layer.mlp)
        assert "forward" in vars(layer.input_layernorm)  # norms are still fused
    only_o = lora.attach(make_model(), LoraConfig(enabled=True, target_modules=["o_proj"]))
    use_fused_layers(only_o)
    assert all("forward" in vars(layer.mlp) and "forward" not in vars(layer.self_attn) for layer in only_o.model.layers)


@pytest.mark.parametrize("wait", [True, False])
def test_checkpoint_resumes_the_adapters_exactly(make_model, make_batch, pg_loss, tmp_path, wait):
    cfg = lora_cfg().model_copy(update={"async_checkpoint": True})
    tr = LocalTrainer(make_model(), cfg, total_steps=4)
    tr.train(make_batch([9, 12, 7], seed=0), pg_loss)
    tr.save(tmp_path / "ckpt", {"step": 1}, wait=wait)  # wait=False: written by a thread
    tr.train(make_batch([9, 12, 7], seed=1), pg_loss)
    again = LocalTrainer(make_model(), cfg, total_steps=4)
    assert again.load(tmp_path / "ckpt") == {"step": 1} and again.step == 1
    again.train(make_batch([9, 12, 7], seed=1), pg_loss)
    want, got = tr.model.state_dict(), again.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
