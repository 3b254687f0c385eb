"""The fast runner's fused operations, in plain torch (the reference, and the CPU path).

Contract: ``kernels/triton_ops.py`` implements the same four functions (``add_rmsnorm``,
``rope_store``, ``decode_attention``, ``silu_mul``) with the same signatures and results up to
rounding; the runner picks one set. Each function's docstring states its contract.

They know nothing of layers, requests or CUDA graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm(x, residual, weight, eps) -> (normed, residual)``: the new
    residual is ``residual + x`` (``x`` itself when ``residual`` is None) and
    ``normed`` is the Llama RMSNorm of it, computed as Hugging Face does (float32
    statistics, cast back, then times the weight).
    """
    residual = x if residual is None else residual + x
    h = residual.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(residual.dtype), residual


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm over the last dim (Qwen3's per-head q / k norms)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_store(qkv: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, nq: int, nkv: int) -> torch.Tensor:
    """``rope_store(qkv, pos, slots, cos, sin, k_cache, v_cache, nq, nkv) -> q``:
    ``qkv`` is ``[T, (nq + 2 nkv) * D]`` (queries, keys, values side by side),
    rotary embedding (rotate-half form, ``cos`` / ``sin`` tables ``[P, D]`` in
    float32 indexed by position) is applied to queries and keys, keys and values
    are written to the token slots ``slots`` of the flat caches ``[S, nkv, D]``, and
    the rotated queries ``[T, nq, D]`` are returned.
    """
    t, d = qkv.shape[0], k_cache.shape[-1]
    q = qkv[:, :nq * d].reshape(t, nq, d)
    k = qkv[:, nq * d:(nq + nkv) * d].reshape(t, nkv, d)
    v = qkv[:, (nq + nkv) * d:].reshape(t, nkv, d)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    q = _rotate(q.float(), c, s).to(qkv.dtype)
    k = _rotate(k.float(), c, s).to(qkv.dtype)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     ctx_lens: torch.Tensor, scale: float, block_size: int, max_ctx: int) -> torch.Tensor:
    """``decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, scale,
    block_size, max_ctx) -> [B, nq * D]``: one query token per row attends over the
    first ``ctx_lens[b]`` tokens of its sequence, whose token ``t`` lives in slot
    ``block_tables[b, t // block_size] * block_size + t % block_size``. Query head
    ``h`` reads KV head ``h // (nq // nkv)`` (grouped-query attention).
    ``max_ctx`` (a host integer >= every ``ctx_lens``) sizes the gather here; the
    Triton kernel ignores it.
    """
    b, nq, d = q.shape
    t = torch.arange(max_ctx, device=q.device)
    pages = block_tables[:, t // block_size].long()
    slots = pages * block_size + (t % block_size)[None, :]  # [B, max_ctx]
    k = k_cache[slots].transpose(1, 2)  # [B, nkv, max_ctx, D]
    v = v_cache[slots].transpose(1, 2)
    mask = (t[None, :] < ctx_lens[:, None].long())[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.reshape(b, nq * d)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu_mul(gu) -> silu(gu[:, :F]) * gu[:, F:]`` for ``gu`` of width ``2F``."""
    f = gu.shape[-1] // 2
    return F.silu(gu[:, :f]) * gu[:, f:]
