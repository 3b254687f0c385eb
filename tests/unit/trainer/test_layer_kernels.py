"""The Triton RMSNorm and SwiGLU, run by Triton's CPU interpreter, against Hugging Face's modules."""
import os
import subprocess
import sys

import pytest

CHECK = r"""
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.trainer.layer_kernels import rms_norm, swiglu, use_fused_layers

g = torch.Generator().manual_seed(0)
# rows not a multiple of the backward's 32 rows per program, widths not powers of two
for dtype, h, rows in ((torch.float32, 96, 70), (torch.bfloat16, 96, 70), (torch.bfloat16, 40, 33)):
    ref = Qwen2RMSNorm(h, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.5 * torch.randn(h, generator=g))
    x = (torch.randn(2, rows, h, generator=g) * 3).to(dtype)
    dy = torch.randn(2, rows, h, generator=g).to(dtype)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    wb = ref.weight.detach().clone().requires_grad_(True)
    ya, yb = ref(xa), rms_norm(xb, wb, ref.variance_epsilon)
    assert yb.dtype == ya.dtype and yb.shape == ya.shape
    exact = dtype == torch.float32
    tol = dict(rtol=0, atol=1e-5) if exact else dict(rtol=1.6e-2, atol=2e-2)  # bf16: within a rounding step
    torch.testing.assert_close(yb, ya, **tol)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    wtol = dict(rtol=1e-5, atol=1e-4) if exact else dict(rtol=2e-2, atol=0.5)  # a sum over 140 rows in bf16
    torch.testing.assert_close(wb.grad.float(), ref.weight.grad.float(), **wtol)

for dtype in (torch.float32, torch.bfloat16):
    gate = (torch.randn(3, 1000, generator=g) * 4).to(dtype)  # 3000 elements: two programs, one partial
    up = torch.randn(3, 1000, generator=g).to(dtype)
    dy = torch.randn(3, 1000, generator=g).to(dtype)
    ga, ua = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    gb, ub = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    ya, yb = torch.nn.functional.silu(ga) * ua, swiglu(gb, ub)
    tol = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(yb, ya, **tol)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(gb.grad, ga.grad, **tol)
    torch.testing.assert_close(ub.grad, ua.grad, **tol)

tok = build_tokenizer()
plain = build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0)
fused = build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0)
assert use_fused_layers(fused) == 7  # two norms and an MLP per layer, and the final norm
ids = torch.randint(5, len(tok), (2, 9), generator=g)
a, b = plain(input_ids=ids).logits, fused(input_ids=ids).logits
torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
a.square().mean().backward()
b.square().mean().backward()
for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
    torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
print("norm ok")
"""


def test_triton_layers_match_hugging_face_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "norm ok" in run.stdout
