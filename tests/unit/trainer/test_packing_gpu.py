"""Packed micro-batches on a GPU: flash variable-length attention under bf16, as close to float32 as padding.

Packed and padded bf16 forwards round differently (other GEMM shapes, another attention kernel),
so they cannot agree bit for bit; what must hold is that the packed logprobs and gradients are
as close to the float32 ones as the padded path's are. (``test_packing.py`` checks exact
agreement on CPU in float32.)"""
import copy
import itertools

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


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_direct_flash_call_equals_torchs_varlen_attn(kv_heads):
    """kernels/flash_varlen.py calls the aten flash kernels that torch's varlen_attn wraps. With as
    many key/value heads as query heads: the same output to the bit, and gradients equal up to the
    backward's float32 accumulation order. With fewer (shared by groups of query heads, native in
    the kernel), against torch's call on the heads repeated: within two bf16 roundings."""
    from conveyor.trainer.kernels import flash_varlen
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        pytest.skip("this torch has no variable-length flash attention")
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 180, 5, 96, 250]
    total, heads, d = sum(lengths), 4, 64
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    make = lambda h: torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v, grad = make(heads), make(kv_heads), make(kv_heads), make(heads)

    def torchs(q, k, v, *args, **kw):
        group = q.shape[1] // k.shape[1]
        return varlen_attn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), *args, **kw)

    results = []
    for fn in (torchs, flash_varlen.varlen_attn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, cu, cu, max(lengths), max(lengths), scale=d ** -0.5, window_size=(-1, 0))
        out.backward(grad)
        results.append([out.detach()] + [x.grad for x in leaves])
    (ref_out, *ref_grads), (out, *grads) = results
    if kv_heads == heads:
        assert torch.equal(out, ref_out)
    for g, r in zip([out] + grads, [ref_out] + ref_grads):
        # the same kernel; its float32 sums may run in another order, then one bf16 rounding
        assert float((g.float() - r.float()).abs().max()) <= 2 * 2 ** -8 * float(r.float().abs().max())
