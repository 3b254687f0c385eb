"""The fused layer forwards in bf16 under autocast: no further from float32 gradients than autocast's
own torch path. Run on CPU by Triton's interpreter, with its float32 -> bf16 casts made to round to
nearest even as a GPU's do (the interpreter truncates); ``test_fused_layers_gpu.py`` is the same check
on a GPU.

The fused forwards move bf16 roundings (the norm output written in bf16, one q/k/v and one gate/up
GEMM, the rotary terms rounded once), so the gradients cannot equal torch's bit for bit; what must
hold is that they are as accurate. An earlier bf16 norm output whose three consumers' gradients
autograd summed in bf16 was less accurate, and learned visibly worse on W2 (docs/benchmarks.md)."""
import pytest

CHECK = r"""
import copy
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

plain_cast = interpreter.InterpreterBuilder.cast_impl


def rounded_cast(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
        return interpreter.TensorHandle(bits.view(np.uint16), dst_type.scalar)
    return plain_cast(self, src, dst_type)


interpreter.InterpreterBuilder.cast_impl = rounded_cast

from transformers import Qwen2Config, Qwen2ForCausalLM
from conveyor.trainer.kernels.layers import use_fused_layers
from conveyor.trainer.precision import linear_copy

cfg = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, attn_implementation="sdpa")


def grads(master, ids, fused, low=True, cache=False):
    m = copy.deepcopy(master)
    c = linear_copy(m, torch.bfloat16)[0] if low else m
    if fused:
        assert use_fused_layers(c) == 9
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
        logits = c(input_ids=ids, use_cache=cache).logits.float()
    logits.log_softmax(-1)[..., 7].mean().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


err, part = {}, {}
for seed in range(3):
    torch.manual_seed(seed)
    master = Qwen2ForCausalLM(cfg)
    ids = torch.randint(5, 300, (4, 40))
    ref = grads(master, ids, fused=False, low=False)
    for kind, kw in (("torch", dict(fused=False)), ("fused", dict(fused=True)),
                     ("fallback", dict(fused=True, cache=True))):
        got = grads(master, ids, **kw)
        for name, r in ref.items():
            e = float((got[name] - r).norm() / r.norm())
            err[kind] = err.get(kind, 0.0) + e
            part[kind, name.split(".")[-2]] = part.get((kind, name.split(".")[-2]), 0.0) + e
print(err)
for kind in ("fused", "fallback"):  # summed relative error against float32, every parameter, three seeds
    assert err[kind] <= 1.03 * err["torch"], (kind, err)
    for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm",
              "post_attention_layernorm"):
        assert part[kind, p] <= 1.15 * part["torch", p], (kind, p, part)
print("numerics ok")
"""


@pytest.mark.slow  # over 10 s on a 2-core CPU
def test_fused_layers_are_as_close_to_float32_as_autocast(interpreted):
    assert "numerics ok" in interpreted(CHECK, timeout=900)
