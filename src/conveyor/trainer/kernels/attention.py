"""The trainer's attention block on a GPU: one q/k/v GEMM and a Triton rotary kernel.

q, k and v come from one GEMM against the three weights concatenated (the
input's gradient is one GEMM summed in float32, which lets the norm in front
write bf16, ``kernels.layers``), and one Triton kernel rotates q and k in
float32 and writes q/k/v in the input dtype, forward and backward, instead of
a dozen float32 passes of the torch rotary embedding.

Contract: ``fused_attention_forward`` replaces the forward of an attention
module with ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` and no per-head
norms (``fusable(module)``); with a KV cache, non-float32 ``cos`` / ``sin`` or
no position embeddings it runs the module's own forward.
``rotary(qkv, cos, sin, heads, kv_heads)`` works on any ``[..., (heads + 2 *
kv_heads) * head_dim]``. ``TRITON_INTERPRET=1`` runs it on CPU tensors (tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ATTENTIONS = {"LlamaAttention", "Qwen2Attention", "MistralAttention"}


@triton.jit
def _rotate(src, dst, cos_row, sin_row, src_off, dst_off, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
            HALF: tl.constexpr, BACKWARD: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    inside = heads < HEADS
    first = heads * (2 * HALF) + cols
    x1 = tl.load(src + src_off + first, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(src + src_off + first + HALF, mask=inside, other=0.0).to(tl.float32)
    c1 = tl.load(cos_row + cols).to(tl.float32)
    c2 = tl.load(cos_row + HALF + cols).to(tl.float32)
    s1 = tl.load(sin_row + cols).to(tl.float32)
    s2 = tl.load(sin_row + HALF + cols).to(tl.float32)
    if BACKWARD:  # the transpose of [x1, x2] -> [x1 c1 - x2 s1, x2 c2 + x1 s2]
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(dst + dst_off + first, y1.to(dst.dtype.element_ty), mask=inside)
    tl.store(dst + dst_off + first + HALF, y2.to(dst.dtype.element_ty), mask=inside)


@triton.jit
def _rotary_forward(qkv, cos, sin, q, k, v, H: tl.constexpr, KV: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_KV: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    width = (H + 2 * KV) * 2 * HALF
    cos_row, sin_row = cos + row * 2 * HALF, sin + row * 2 * HALF
    _rotate(qkv, q, cos_row, sin_row, row * width, row * H * 2 * HALF, H, BLOCK_H, HALF, False)
    _rotate(qkv, k, cos_row, sin_row, row * width + H * 2 * HALF, row * KV * 2 * HALF, KV, BLOCK_KV, HALF, False)
    cols = tl.arange(0, BLOCK_KV * 2 * HALF)
    inside = cols < KV * 2 * HALF
    vals = tl.load(qkv + row * width + (H + KV) * 2 * HALF + cols, mask=inside, other=0.0)
    tl.store(v + row * KV * 2 * HALF + cols, vals, mask=inside)


@triton.jit
def _rotary_backward(dq, dk, dv, cos, sin, dqkv, H: tl.constexpr, KV: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_KV: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    width = (H + 2 * KV) * 2 * HALF
    cos_row, sin_row = cos + row * 2 * HALF, sin + row * 2 * HALF
    _rotate(dq, dqkv, cos_row, sin_row, row * H * 2 * HALF, row * width, H, BLOCK_H, HALF, True)
    _rotate(dk, dqkv, cos_row, sin_row, row * KV * 2 * HALF, row * width + H * 2 * HALF, KV, BLOCK_KV, HALF, True)
    cols = tl.arange(0, BLOCK_KV * 2 * HALF)
    inside = cols < KV * 2 * HALF
    vals = tl.load(dv + row * KV * 2 * HALF + cols, mask=inside, other=0.0)
    tl.store(dqkv + row * width + (H + KV) * 2 * HALF + cols, vals.to(dqkv.dtype.element_ty), mask=inside)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
        lead, width = qkv.shape[:-1], qkv.shape[-1]
        dim = width // (heads + 2 * kv_heads)
        rows = qkv.numel() // width
        flat = qkv.reshape(rows, width).contiguous()
        cos = cos.expand(*lead, dim).reshape(rows, dim).contiguous()
        sin = sin.expand(*lead, dim).reshape(rows, dim).contiguous()
        q = torch.empty((rows, heads * dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((rows, kv_heads * dim), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        if rows:
            _rotary_forward[(rows,)](flat, cos, sin, q, k, v, H=heads, KV=kv_heads,
                                     BLOCK_H=triton.next_power_of_2(heads),
                                     BLOCK_KV=triton.next_power_of_2(kv_heads), HALF=dim // 2, num_warps=4)
        ctx.save_for_backward(cos, sin)
        ctx.meta = (lead, width, heads, kv_heads, dim)
        return (q.view(*lead, heads, dim), k.view(*lead, kv_heads, dim), v.view(*lead, kv_heads, dim))

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        lead, width, heads, kv_heads, dim = ctx.meta
        rows = cos.shape[0]
        # (autograd materialises the gradient of an unused output as zeros: none is None)
        grads = [g.reshape(rows, n * dim).contiguous() for g, n in ((dq, heads), (dk, kv_heads), (dv, kv_heads))]
        dqkv = torch.empty((rows, width), dtype=dq.dtype, device=dq.device)
        if rows:
            _rotary_backward[(rows,)](*grads, cos, sin, dqkv, H=heads, KV=kv_heads,
                                      BLOCK_H=triton.next_power_of_2(heads),
                                      BLOCK_KV=triton.next_power_of_2(kv_heads), HALF=dim // 2, num_warps=4)
        return dqkv.view(*lead, width), None, None, None, None


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """Packed ``[..., (heads + 2 kv_heads) * d]`` -> rotated q ``[..., heads, d]``, rotated k and v
    ``[..., kv_heads, d]`` (each new and contiguous); ``cos`` / ``sin`` ``[..., d]`` (broadcast
    over the leading dimensions), applied as Hugging Face's ``x * cos + rotate_half(x) * sin``."""
    width = qkv.shape[-1]
    if width % (heads + 2 * kv_heads) or (width // (heads + 2 * kv_heads)) % 2:
        raise ValueError(f"rotary: width {width} is not (heads {heads} + 2 x kv_heads {kv_heads}) x an even head dim")
    return _Rotary.apply(qkv, cos, sin, heads, kv_heads)


def fusable(module: torch.nn.Module) -> bool:
    """An attention module this forward reproduces: the known classes without per-head norms
    (Qwen3 normalises q and k after the projections)."""
    config = getattr(module, "config", None)
    return (type(module).__name__ in ATTENTIONS and not hasattr(module, "q_norm")
            and all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
            # a wrapped projection (a LoRA adapter's layer) is more than its weight: keep HF's forward
            and all(type(getattr(module, p)) is torch.nn.Linear for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and _attention_function(getattr(config, "_attn_implementation", None)) is not None)


def _attention_function(name: str):
    """Hugging Face's registered attention kernel ``name`` (sdpa, flash, ...), None for eager."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    try:
        return ALL_ATTENTION_FUNCTIONS[name]
    except KeyError:
        return None


def fused_attention_forward(module, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                            *args, **kwargs):
    """Hugging Face's attention forward with one q/k/v GEMM and the fused rotary kernel.

    The GEMM runs against the three weights concatenated (a copy of a few MiB per layer and
    micro-batch); the concatenation's gradient hands each weight its own rows, and the input's
    gradient is one GEMM summed in float32 before its single rounding (torch summed three rounded
    ones), which lets the norm in front write bf16. Forward numbers are the torch ops' (up to a
    fused multiply-add); the backward rounds once where torch rounds the two rotary terms apart.
    With a KV cache (the trainers pass ``use_cache=False``), non-float32 ``cos`` / ``sin`` or no
    position embeddings it runs the module's own forward, on a float32 copy of its input under
    autocast.
    """
    cache = kwargs.get("past_key_values", kwargs.get("cache", args[0] if args else None))
    attend = _attention_function(module.config._attn_implementation)
    if (cache is not None or attend is None or position_embeddings is None
            or position_embeddings[0].dtype != torch.float32):
        if torch.is_autocast_enabled(hidden_states.device.type):
            # the norm in front wrote bf16 for one GEMM; for three, their input gradients are
            # summed in float32 (the cast's backward) and rounded once, as the fused GEMM does
            hidden_states = hidden_states.float()
        return type(module).forward(module, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    projections = (module.q_proj, module.k_proj, module.v_proj)
    weight = torch.cat([p.weight for p in projections])
    bias = None if module.q_proj.bias is None else torch.cat([p.bias for p in projections])
    heads = module.q_proj.out_features // module.head_dim
    kv_heads = module.k_proj.out_features // module.head_dim
    cos, sin = position_embeddings
    q, k, v = rotary(F.linear(hidden_states, weight, bias), cos, sin, heads, kv_heads)
    extra = {"sliding_window": module.sliding_window} if hasattr(module, "sliding_window") else {}
    for name in ("past_key_values", "cache"):  # None here; the attention kernels take no cache
        kwargs.pop(name, None)
    out, weights = attend(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask,
                          dropout=0.0 if not module.training else module.attention_dropout,
                          scaling=module.scaling, **extra, **kwargs)
    return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights
