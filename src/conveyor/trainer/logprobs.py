"""Per-token logprobs from logits, without a float32 copy of the whole vocabulary.

- ``token_logprobs(logits, input_ids, attention_mask, ...)``: ``[b, L]`` where position t holds
  ``log_softmax(logits[t-1] / temperature)[x_t]`` (0.0 at position 0 and padding), optionally
  with the entropy; ``target_logprobs`` the same head on ``[N, V]`` rows.
- Chunked (``TargetLogprob``, or ``kernels.logprob`` on CUDA with Triton), the float32
  ``[b, L, V]`` copy, its softmax and its gradient never exist; values and gradients equal the
  plain form to float rounding (tested).

It knows nothing of models, losses or devices.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


# A CPU chunk's float32 logits at most (a few rows of a large vocabulary): converted, reduced and
# differentiated while in the cache instead of streamed through memory. On a 2-core AMD EPYC (1 MiB
# of L2 per core, 32 MiB L3), 512 positions of bf16 logits, forward and backward: 44 against 128 ms at
# SmolLM2's 49,152 ids (16 rows a chunk against 1,024), 131-147 against 384 ms at Qwen's 151,936.
CPU_CHUNK_BYTES = 3 << 20


def cpu_chunk(rows: int, vocab: int) -> int:
    """``rows`` held to what keeps a chunk's float32 logits within ``CPU_CHUNK_BYTES`` (at least 1)."""
    return max(1, min(rows, CPU_CHUNK_BYTES // (4 * max(vocab, 1))))


class TargetLogprob(torch.autograd.Function):
    """``[N, V]`` logits, ``[N]`` targets -> ``[N]`` float32 ``log_softmax(logits / T)[target]``;
    rows with a negative target give 0 and no gradient.

    Backward: d out_i / d logits_ij = ([j == t_i] - p_ij) / T with p = softmax(logits_i / T).
    With ``kernel`` both passes are ``kernels.logprob``'s (one read of the logits each),
    otherwise torch ops over ``chunk`` rows at a time.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, temperature: float, chunk: int, kernel: bool):
        if logits.device.type == "cpu":
            chunk = cpu_chunk(chunk, logits.shape[-1])
        ctx.temperature, ctx.chunk, ctx.kernel = temperature, chunk, kernel
        if kernel:
            from conveyor.trainer.kernels import logprob as logprob_kernel
            out, lse = logprob_kernel.forward(logits, target, temperature)
            ctx.save_for_backward(logits, target, lse)
            return out
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        picked = target.clamp(min=0)
        for s in range(0, n, chunk):
            x = _scaled(logits[s:s + chunk], temperature)
            lse[s:s + chunk] = torch.logsumexp(x, dim=-1)
            out[s:s + chunk] = x.gather(-1, picked[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
        ctx.save_for_backward(logits, target, lse)
        return out.masked_fill_(target < 0, 0.0)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        if ctx.kernel:
            from conveyor.trainer.kernels import logprob as logprob_kernel
            return logprob_kernel.backward(logits, target, lse, grad_out, ctx.temperature), None, None, None, None
        grad = torch.empty_like(logits)
        grad_out = grad_out.float().masked_fill(target < 0, 0.0)
        picked = target.clamp(min=0)
        for s in range(0, logits.shape[0], ctx.chunk):
            g = grad_out[s:s + ctx.chunk, None]
            p = _scaled(logits[s:s + ctx.chunk], ctx.temperature).sub_(lse[s:s + ctx.chunk, None]).exp_()
            p.mul_(-g).scatter_add_(-1, picked[s:s + ctx.chunk, None], g)
            if ctx.temperature != 1.0:
                p.div_(ctx.temperature)
            grad[s:s + ctx.chunk] = p
        return grad, None, None, None, None


@functools.lru_cache(maxsize=None)
def kernel_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    x = x.float() if x.dtype != torch.float32 else x.clone()  # a fresh float32 chunk, safe to edit in place
    return x.div_(temperature) if temperature != 1.0 else x


def target_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                    chunk_rows: int | None = 1024, kernel: bool | None = None) -> torch.Tensor:
    """``[N, V]`` logits, ``[N]`` targets -> ``[N]`` float32 logprobs (0 where the target is negative)."""
    if kernel is None:
        kernel = logits.is_cuda and kernel_available()
    return TargetLogprob.apply(logits, target, float(temperature), int(chunk_rows or 1024), bool(kernel))


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    temperature: float = 1.0, with_entropy: bool = False, chunk_rows: int | None = 1024,
    kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (and optionally entropy) of ``[b, L, V]`` logits, chunked.

    - ``token_logprobs(logits, input_ids, attention_mask, temperature, with_entropy,
      chunk_rows)``: ``[b, L, V]`` logits -> ``[b, L]`` where position t holds
      ``log_softmax(logits[t-1] / temperature)[x_t]``; position 0 and padding hold
      0.0. With ``with_entropy`` also the entropy of the same distributions.
    - With ``chunk_rows`` (default) and no entropy, ``TargetLogprob`` computes the
      result ``chunk_rows`` positions at a time in float32 and keeps only the
      logits (in their own dtype) and one logsumexp per position for backward,
      which it also does chunk by chunk: the float32 ``[b, L, V]`` copy, its
      softmax and its gradient (three vocabulary-sized float32 tensors, the
      largest memory of an RL step at a 150k vocabulary) never exist. Values and
      gradients equal the plain form to float rounding (tested).
    - On CUDA with Triton installed (``kernel=None``: auto) both passes are
      ``kernels.logprob``'s instead: one read of the logits per pass, padding and
      each row's last position skipped. ``kernel=False`` forces the torch form.
    - ``target_logprobs(logits, target, temperature)``: the same head on ``[N, V]``
      logits and ``[N]`` targets (the packed forward's rows, ``packing.py``).
    - ``chunk_rows=None`` (or ``with_entropy``) is the plain autograd form.
    - On a CPU a chunk is also held to ``CPU_CHUNK_BYTES`` of float32 logits, so that
      it is still in the cache when the next operation reads it (``cpu_chunk``).
    """
    mask = attention_mask[:, 1:].float()
    if chunk_rows and not with_entropy:
        b, length, vocab = logits.shape
        # Every position predicts the next id; the last one and padding predict nothing
        # (target -1: skipped), which keeps the logits a free [b * L, V] view instead of a copy.
        target = F.pad(input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -1), (0, 1), value=-1)
        if kernel is None:
            kernel = logits.is_cuda and kernel_available()
        lp = TargetLogprob.apply(logits.reshape(b * length, vocab), target.reshape(-1), float(temperature),
                                 int(chunk_rows), bool(kernel))
        return F.pad(lp.view(b, length)[:, :-1] * mask, (1, 0)), None
    scores = logits[:, :-1].float()
    if temperature != 1.0:
        scores = scores / temperature
    lse = torch.logsumexp(scores, dim=-1)
    target = scores.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    logprobs = F.pad((target - lse) * mask, (1, 0))
    entropy = None
    if with_entropy:
        probs = torch.softmax(scores, dim=-1)
        entropy = F.pad((lse - (probs * scores).sum(-1)) * mask, (1, 0))
    return logprobs, entropy
