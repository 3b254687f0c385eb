"""Causal variable-length flash attention for packed micro-batches, called straight into aten.

``torch.nn.attention.varlen.varlen_attn`` wraps the same flash kernels in a Python custom op
whose dispatch and autograd cost host time a small model's trainer cannot spare; this module
calls ``aten._flash_attention_forward`` / ``_backward`` from one ``autograd.Function``: the
same kernels with the same arguments, so the same numbers.

Contract: ``available()`` says whether this torch has the two aten ops (CUDA builds do);
``varlen_attn(...)`` takes ``varlen_attn``'s arguments for the causal case (``[T, H, D]``
tensors, grouped-query heads natively) and returns ``[T, H, D]``. Other windows are refused.
CUDA, bf16/fp16 only (the kernel's).
"""
from __future__ import annotations

import torch


def available() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(torch.ops.aten, "_flash_attention_backward")


class _Causal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.sizes = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        max_q, max_k, scale = ctx.sizes
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
        return dq, dk, dv, None, None, None, None, None


def varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q: int, max_k: int, scale=None, window_size=(-1, 0),
                enable_gqa: bool = True) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` wraps the same flash kernels in a Python custom op,
    whose dispatch and Python-side autograd cost about half a millisecond of host time per call
    each way (profiled on an H200 host: 144 calls a W1 step, 0.5B). The trainer of a small model is
    bound by its host launching kernels, so that time is the GPU's idle time. This module calls
    ``aten._flash_attention_forward`` / ``_backward`` from one ``autograd.Function``: the same
    kernels with the same arguments, so the same numbers.

    ``varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=None, window_size=(-1, 0),
    enable_gqa=True)`` takes ``varlen_attn``'s arguments for the causal case (``[T, H, D]``
    tensors) and returns ``[T, H, D]``; ``k``/``v`` may have fewer heads, each shared by a group of
    query heads, which the flash kernel does natively (``enable_gqa`` is accepted and implied:
    torch's own ``varlen_attn`` lacks it before 2.12, and the caller then repeats the heads).
    """
    if tuple(window_size) != (-1, 0):
        raise ValueError(f"flash_varlen: only causal attention (window_size=(-1, 0)), got {window_size}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_varlen: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    return _Causal.apply(q, k, v, cu_seq_q, cu_seq_k, int(max_q), int(max_k), scale)
