"""param_dtype=bfloat16: forward and backward on bf16 copies of the linear weights (every other tensor shared
with the float32 masters) under autocast, float32 master weights and gradients."""
import pytest
import torch
from safetensors.torch import load_file

from conveyor.config import TrainerConfig
from conveyor.trainer.single import LocalTrainer

LENGTHS = [9, 4, 12, 6, 7, 3, 10, 5]


def cfg(**kw):
    return TrainerConfig(**{"device": "cpu", "lr": 1e-3, "micro_batch_tokens": 4096, **kw})


def params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def assert_copy_matches_masters(trainer):
    linear = {id(m.weight) for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)}
    embedded = {id(m.weight) for m in trainer.model.modules() if isinstance(m, torch.nn.Embedding)}
    copied = 0
    for w, m in zip(trainer.compute.parameters(), trainer.model.parameters()):
        assert m.dtype == torch.float32
        if id(m) in linear - embedded:
            assert w.dtype == torch.bfloat16 and torch.equal(w, m.to(torch.bfloat16))
            copied += 1
        else:
            assert w is m  # embeddings, norms, biases: the masters themselves
    assert copied == len(trainer._copies) > 0


def test_a_bf16_step_updates_float32_masters_like_a_float32_step(make_model, make_batch, pg_loss):
    batch = make_batch(LENGTHS)
    start = params(make_model())
    exact = LocalTrainer(make_model(), cfg(), total_steps=4)
    half = LocalTrainer(make_model(), cfg(param_dtype="bfloat16"), total_steps=4)
    assert exact.compute is exact.model and half.compute is not half.model
    for _ in range(2):
        m32, m16 = exact.train(batch, pg_loss), half.train(batch, pg_loss)
        assert m16["loss"] == pytest.approx(m32["loss"], abs=2e-2)
        assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=5e-2)
    assert_copy_matches_masters(half)
    d32, d16 = params(exact.model) - start, params(half.model) - start
    # Adam's first steps move every weight by about lr; the two runs agree in direction.
    assert float(torch.nn.functional.cosine_similarity(d32, d16, dim=0)) > 0.9
    assert all(p.grad is None for p in half.compute.parameters())  # nothing left in bf16


def test_bf16_gradients_of_micro_batches_sum_in_float32(make_model, make_batch, pg_loss):
    batch = make_batch(LENGTHS)
    one = LocalTrainer(make_model(), cfg(param_dtype="bfloat16", micro_batch_tokens=10**6), total_steps=2)
    many = LocalTrainer(make_model(), cfg(param_dtype="bfloat16", micro_batch_tokens=1), total_steps=2)
    m1, m8 = one.train(batch, pg_loss), many.train(batch, pg_loss)
    assert (m1["microbatches"], m8["microbatches"]) == (1.0, 8.0)
    # A hook that kept only the last micro-batch's gradient would give a far smaller norm.
    assert m8["grad_norm"] == pytest.approx(m1["grad_norm"], rel=2e-2)
    start = params(make_model())
    d1, d8 = params(one.model) - start, params(many.model) - start
    assert float(torch.nn.functional.cosine_similarity(d1, d8, dim=0)) > 0.99


def test_bf16_logprobs_come_from_the_copy(make_model, make_batch):
    batch = make_batch([7, 5])
    exact = LocalTrainer(make_model(), cfg(), total_steps=1)
    half = LocalTrainer(make_model(), cfg(param_dtype="bfloat16"), total_steps=1).logprobs(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = exact.logprobs(batch)
    for a, b, c in zip(exact.logprobs(batch), half, autocast):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=0, atol=5e-2)
        assert not torch.equal(a, b)  # really computed in bf16
        assert torch.equal(b, c)  # the numbers of float32 weights under autocast


def test_checkpoints_hold_the_float32_masters(make_model, make_batch, pg_loss, tmp_path):
    batch = make_batch(LENGTHS)
    trainer = LocalTrainer(make_model(), cfg(param_dtype="bfloat16"), total_steps=4)
    trainer.train(batch, pg_loss)
    trainer.save(tmp_path / "ckpt")
    saved = load_file(str(tmp_path / "ckpt" / "policy" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in saved.values())
    restored = LocalTrainer(make_model(), cfg(param_dtype="bfloat16"), total_steps=4)
    restored.load(tmp_path / "ckpt")
    assert float((params(restored.model) - params(trainer.model)).abs().max()) == 0.0
    assert_copy_matches_masters(restored)
    assert dict(trainer.named_weights()).keys() == dict(restored.named_weights()).keys()
    assert {t.dtype for _, t in trainer.named_weights()} == {torch.float32}


def test_weights_for_bf16_engines_are_the_masters_rounded(make_model, make_batch, pg_loss):
    trainer = LocalTrainer(make_model(), cfg(param_dtype="bfloat16"), total_steps=4)
    trainer.train(make_batch(LENGTHS), pg_loss)
    masters = dict(trainer.named_weights())
    rounded = dict(trainer.named_weights(torch.bfloat16))
    assert rounded.keys() == masters.keys()
    linear = {n + ".weight" for n, m in trainer.model.named_modules() if isinstance(m, torch.nn.Linear)}
    copies = {n for n, t in rounded.items() if t.dtype == torch.bfloat16}
    assert copies and copies <= linear
    for name, t in rounded.items():
        if name in copies:  # the compute copy: the masters rounded, no cast per publish
            assert torch.equal(t, masters[name].to(torch.bfloat16)), name
        else:  # the master itself: transports cast while copying
            assert t.data_ptr() == masters[name].data_ptr(), name
    before = {n: t.clone() for n, t in rounded.items()}
    trainer.train(make_batch(LENGTHS), pg_loss)  # the listed tensors follow the next step
    again = dict(trainer.named_weights(torch.bfloat16))
    assert all(again[n] is rounded[n] for n in rounded)
    assert any(not torch.equal(again[n], before[n]) for n in copies)
    for name, t in dict(trainer.named_weights()).items():
        assert torch.equal(again[name].to(torch.bfloat16), t.to(torch.bfloat16)), name
    assert {t.dtype for t in dict(trainer.named_weights(torch.float16)).values()} == {torch.float32}
