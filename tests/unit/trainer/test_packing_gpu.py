"""Packed micro-batches on a GPU: flash variable-length attention under bf16, as close to float32 as padding.

Packed and padded bf16 forwards round differently (other GEMM shapes, another attention kernel),
so they cannot agree bit for bit; what must hold is that the packed logprobs and gradients are
as close to the float32 ones as the padded path's are. (``test_packing.py`` checks exact
agreement on CPU in float32.)"""
import copy

import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.trainer import packing
from conveyor.trainer.single import LocalTrainer
from conveyor.trainer.step_metrics import MetricMean
from conveyor.types import Batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batch(lengths, vocab, seed=0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
    masks = [torch.cat([torch.zeros(n // 3), torch.ones(n - n // 3)]) for n in lengths]
    adv = [torch.randn(n, generator=gen) * m for n, m in zip(lengths, masks)]
    return Batch(ids, masks, {"adv": adv})


def _loss(out, mb, num_tokens, num_seqs):
    return -(mb["adv"] * out["logprobs"] * mb["loss_mask"]).sum() / num_tokens, {}


def _grads(trainer: LocalTrainer, batch: Batch) -> torch.Tensor:
    trainer.compute.train()
    trainer._backward(batch, _loss, float(batch.num_tokens), len(batch), 4096, MetricMean(),
                      {"loss": 0.0, "microbatches": 0}, "test")
    flat = torch.cat([p.grad.float().flatten() for p in trainer.model.parameters()])
    trainer._zero_grad()
    return flat


def test_packed_is_as_close_to_float32_as_padded_on_gpu(monkeypatch):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if packing._flash_varlen() is None:
        pytest.skip("this torch has no variable-length flash attention")
    config = Qwen2Config(vocab_size=3000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    master = Qwen2ForCausalLM(config)
    batch = _batch([37, 180, 5, 96, 250, 64, 12, 130], config.vocab_size)
    base = {"device": "cuda", "lr": 1e-4, "micro_batch_tokens": 4096}
    exact = LocalTrainer(copy.deepcopy(master), TrainerConfig(**base, pack_sequences="off", autocast_bf16=False,
                                                              param_dtype="float32", kernels=False), 1)
    padded = LocalTrainer(copy.deepcopy(master), TrainerConfig(**base, pack_sequences="off"), 1)
    packed = LocalTrainer(copy.deepcopy(master), TrainerConfig(**base), 1)  # auto: packs on a GPU
    assert packed._packed and not padded._packed
    calls = []
    flash = packing._flash_varlen()
    monkeypatch.setattr(packing, "_flash_varlen", lambda: lambda *a, **k: calls.append(1) or flash(*a, **k))
    ref = exact.logprobs(batch)
    err = {}
    for name, trainer in (("padded", padded), ("packed", packed)):
        got = trainer.logprobs(batch)
        err[name] = max(float((g - r)[m > 0].abs().max()) for g, r, m in zip(got, ref, batch.loss_mask))
    assert calls, "the packed forward did not use flash variable-length attention"
    # bf16 carries 8 bits: the packed path may round differently, not worse (25% slack on one max).
    assert err["packed"] <= 1.25 * err["padded"] + 1e-3, err
    g_ref, g_pad, g_pk = _grads(exact, batch), _grads(padded, batch), _grads(packed, batch)
    rel = {name: float((g - g_ref).norm() / g_ref.norm()) for name, g in (("padded", g_pad), ("packed", g_pk))}
    assert rel["packed"] <= 1.25 * rel["padded"] + 1e-3, rel
