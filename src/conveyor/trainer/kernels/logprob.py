"""Triton kernels for ``TargetLogprob`` on a GPU: one read of the logits per pass.

The forward reads each row once (an online max and sum of exponentials) and the backward reads
it once and writes its gradient once, in the logits' own dtype; rows whose target is negative
are skipped (output 0, gradient 0).

Contract: ``forward(logits [N, V], target [N] int64, temperature) -> (out, lse)``,
both float32 ``[N]``; ``backward(logits, target, lse, grad_out, temperature)``
-> ``[N, V]`` gradient in the logits' dtype. ``logits`` rows must be contiguous
(stride 1 along V). Set ``TRITON_INTERPRET=1`` before importing to run on CPU
tensors (tests do).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # the vocabulary is a compile-time constant (one model per process): loops unroll to its size


@triton.jit
def _forward(logits, stride, target, out, lse_out, inv_t, vocab: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(target + row)
    if t < 0:
        tl.store(out + row, 0.0)
        tl.store(lse_out + row, 0.0)
    else:
        base = logits + row.to(tl.int64) * stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, x)
            # Lanes that have seen only padding stay at -inf; keep their sum at 0, not NaN.
            s = s * tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new)) \
                + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
            m = m_new
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
        picked = tl.load(base + t).to(tl.float32) * inv_t
        tl.store(out + row, picked - lse)
        tl.store(lse_out + row, lse)


@triton.jit
def _backward(logits, stride, target, lse_in, grad_out, grad, inv_t, vocab: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(target + row)
    g = tl.where(t < 0, 0.0, tl.load(grad_out + row).to(tl.float32))
    src = logits + row.to(tl.int64) * stride
    dst = grad + row.to(tl.int64) * vocab
    lse = tl.load(lse_in + row)
    cols = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        inside = idx < vocab
        x = tl.load(src + idx, mask=inside, other=0.0).to(tl.float32) * inv_t
        # d out / d logit_j = ([j == t] - softmax_j) / T
        d = (tl.where(idx == t, 1.0, 0.0) - tl.exp(x - lse)) * (g * inv_t)
        tl.store(dst + idx, d.to(grad.dtype.element_ty), mask=inside)


def forward(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form (``logprobs.TargetLogprob``) goes over each chunk of ``[N, V]``
    logits about ten times in float32 (cast, max, exp, sum, gather; in backward
    cast, subtract, exp, scale, write): on a 0.5B model with a 152k vocabulary
    that was a quarter of a training step's kernel time. Here the forward reads
    each row once (an online max and sum of exponentials) and the backward reads
    it once and writes its gradient once, in the logits' own dtype.

    Rows whose target is negative are skipped (output 0, gradient 0): the caller
    marks positions that no loss reads (padding, each row's last position).
    """
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(out)
    if n:
        _forward[(n,)](logits, logits.stride(0), target, out, lse, 1.0 / temperature, vocab=vocab,
                       BLOCK=BLOCK, num_warps=8)
    return out, lse


def backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
             temperature: float) -> torch.Tensor:
    n, vocab = logits.shape
    grad = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n:
        _backward[(n,)](logits, logits.stride(0), target, lse, grad_out.contiguous(), grad,
                        1.0 / temperature, vocab=vocab, BLOCK=BLOCK, num_warps=8)
    return grad
