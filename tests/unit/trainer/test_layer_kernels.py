"""The Triton RMSNorm, SwiGLU and rotary kernels and the fused layer forwards, run by Triton's CPU
interpreter, against Hugging Face's modules. The interpreter truncates float32 -> bf16 where a GPU
rounds to nearest, so bf16 numerics are checked on a GPU (test_fused_layers_gpu.py)."""
import pytest

CHECK = r"""
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.trainer.kernels.layers import rms_norm, swiglu, use_fused_layers

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

# packed: one [..., 2 w] tensor holding gate then up in each row (what the fused gate/up GEMM writes)
packed = (torch.randn(2, 5, 2 * 700, generator=g) * 3).requires_grad_(True)
split = packed.detach().clone().requires_grad_(True)
ya, yb = torch.nn.functional.silu(split[..., :700]) * split[..., 700:], swiglu(packed)
torch.testing.assert_close(yb, ya, rtol=1e-6, atol=2e-6)
dy = torch.randn(2, 5, 700, generator=g)
ya.backward(dy)
yb.backward(dy)
torch.testing.assert_close(packed.grad, split.grad, rtol=1e-6, atol=2e-6)
try:
    swiglu(torch.zeros(3, 7))
    raise AssertionError("an odd packed width was accepted")
except ValueError as e:
    assert "even last dimension" in str(e)

# rotary: q, k, v out of one packed projection, against Hugging Face's formula
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
from conveyor.trainer.kernels.attention import rotary
heads, kv, d = 6, 2, 16
qkv = torch.randn(3, 7, (heads + 2 * kv) * d, generator=g, requires_grad=True)
ang = torch.randn(3, 7, d // 2, generator=g)
cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
q, k, v = rotary(qkv, cos, sin, heads, kv)
ref = qkv.detach().clone().requires_grad_(True)
rq, rk, rv = ref.view(3, 7, heads + 2 * kv, d).split([heads, kv, kv], dim=2)
rq, rk = apply_rotary_pos_emb(rq.transpose(1, 2), rk.transpose(1, 2), cos, sin)
for mine, theirs in ((q, rq.transpose(1, 2)), (k, rk.transpose(1, 2)), (v, rv)):
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
grads = [torch.randn(t.shape, generator=g) for t in (q, k, v)]
torch.autograd.backward([q, k, v], grads)
torch.autograd.backward([rq.transpose(1, 2), rk.transpose(1, 2), rv], grads)
torch.testing.assert_close(qkv.grad, ref.grad, rtol=0, atol=1e-6)
try:
    rotary(torch.zeros(2, 3, 90), cos, sin, heads, kv)
    raise AssertionError("a width that is no head layout was accepted")
except ValueError as e:
    assert "even head dim" in str(e)

tok = build_tokenizer()
plain = build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0)
fused = build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0)
assert use_fused_layers(fused) == 9  # two norms, an attention and an MLP per layer, and the final norm
assert sum(getattr(m, "feeds_one_gemm", False) for m in fused.modules()) == 4  # not the final norm
ids = torch.randint(5, len(tok), (2, 9), generator=g)
# use_cache=False, as the trainers pass it: with a KV cache the attention runs Hugging Face's own forward
a, b = plain(input_ids=ids, use_cache=False).logits, fused(input_ids=ids, use_cache=False).logits
torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
a.square().mean().backward()
b.square().mean().backward()
for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
    torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)

# Qwen2: q/k/v biases, and positions that differ between rows (as the trainer's right padding makes)
from transformers import Qwen2Config, Qwen2ForCausalLM
cfg = Qwen2Config(vocab_size=120, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, tie_word_embeddings=False, attn_implementation="sdpa")
torch.manual_seed(1)
plain = Qwen2ForCausalLM(cfg)
with torch.no_grad():
    for name, p in plain.named_parameters():
        if name.endswith("bias"):
            p.normal_(0, 0.5)
fused = Qwen2ForCausalLM(cfg)
fused.load_state_dict(plain.state_dict())
assert use_fused_layers(fused) == 9
ids = torch.randint(3, 120, (3, 11), generator=g)
pos = torch.tensor([list(range(11)), list(range(3, 14)), [0] * 4 + list(range(7))])
import conveyor.trainer.kernels.attention as attention
rotations = []
attention_rotary = attention.rotary
attention.rotary = lambda *a: rotations.append(1) or attention_rotary(*a)
a = plain(input_ids=ids, position_ids=pos, use_cache=False).logits
b = fused(input_ids=ids, position_ids=pos, use_cache=False).logits
assert len(rotations) == 2  # the fused attention ran in both layers
fused(input_ids=ids, position_ids=pos)  # with a KV cache: Hugging Face's forward
assert len(rotations) == 2
torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
a.log_softmax(-1)[..., 5].mean().backward()
b.log_softmax(-1)[..., 5].mean().backward()
for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
    torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)
print("norm ok")
"""


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_triton_layers_match_hugging_face_in_the_interpreter(interpreted):
    assert "norm ok" in interpreted(CHECK, timeout=600)
