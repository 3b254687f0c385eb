"""Packed sequences: a micro-batch's samples as one row, without padding.

A padded micro-batch spends compute on padding (about a fifth of the tokens
at a 16k-token budget with heavy-tail lengths) and runs the vocabulary head
over every position. Packed, the samples' real tokens sit end to end in one
``[1, T]`` row, each sample attends only to itself (variable-length
attention), and the head runs only over the positions whose next token is
wanted. Values and gradients equal the padded forward's to float rounding
(tested).

Contract
- ``wanted(cfg, device)``: whether ``trainer.pack_sequences`` packs here
  (``auto``: on a GPU whose torch has variable-length flash attention).
- ``install(model)`` registers the ``conveyor_varlen`` attention with
  Hugging Face and switches ``model`` to it. Called with ``cu_seq_lens_q``
  (a packed forward), it runs flash variable-length attention on CUDA in
  bf16/fp16 and a causal attention per sample elsewhere (CPU, float32);
  called without (a padded forward), it is plain causal SDPA, which is exact
  for the real tokens of right-padded rows.
- ``plan(lengths, max_tokens)``: sample indices in groups whose summed
  length fits ``max_tokens`` (first fit, longest first; a longer sample
  alone), covering every sample once.
- ``logprobs(model, mb, need, temperature, with_entropy, logprob)``: the
  padded micro-batch ``mb`` (``input_ids`` / ``attention_mask`` ``[b, L]``,
  right-padded, on the device) forwarded packed; returns ``[b, L]`` float32
  logprobs (and entropy) where ``need`` (``[b, L]`` bool) is set and 0.0
  elsewhere, in the padded layout of ``trainer/api.py``.

It knows nothing of losses, optimizers or where the batch came from.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

NAME = "conveyor_varlen"
MODES = ("auto", "on", "off")


def plan(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so each group's summed length is within ``max_tokens``.

    >>> plan([3, 5, 2, 5], 10)
    [[1, 3], [0, 2]]
    """
    if max_tokens < 1:
        raise ValueError(f"packing.plan: max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((g for g, r in enumerate(room) if r >= lengths[i]), None)
        if slot is None:
            groups.append([i])
            room.append(max_tokens - lengths[i])
        else:
            groups[slot].append(i)
            room[slot] -= lengths[i]
    return groups


@functools.cache
def _flash_varlen() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def wanted(mode: str, device: torch.device, compiled: bool) -> bool:
    """Whether to pack: ``mode`` is ``trainer.pack_sequences``."""
    if mode not in MODES:
        raise ValueError(f"trainer.pack_sequences={mode!r}; use auto, on or off")
    if mode == "on" and compiled:
        raise ValueError("trainer.pack_sequences=on does not combine with trainer.compile=true; "
                         "set one of them off")
    if mode == "auto":
        return device.type == "cuda" and _flash_varlen() is not None and not compiled
    return mode == "on"


def install(model: torch.nn.Module) -> None:
    """Register the packed attention and make ``model`` use it (in place)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, ValueError):  # an older transformers: the config field itself
        model.config._attn_implementation = NAME
    if getattr(model.config, "_attn_implementation", None) != NAME:
        raise ValueError(f"trainer.pack_sequences: {type(model).__name__} did not take the packed attention; "
                         "set trainer.pack_sequences=off")


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """Hugging Face's attention signature: ``[1, H, T, D]`` q/k/v in, ``[1, T, H, D]`` out."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError("trainer.pack_sequences: attention dropout is not supported packed; "
                         "set trainer.pack_sequences=off")
    flash = _flash_varlen()
    if flash is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        out = flash(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, cu_seq_lens_q,
                    int(max_length_q), int(max_length_q), scale=scaling, window_size=(-1, 0))
        return out[None], None
    return _per_sample(query, key, value, cu_seq_lens_q.tolist(), scaling), None


def _per_sample(query, key, value, cu: list[int], scaling) -> torch.Tensor:
    gqa = key.shape[1] != query.shape[1]
    parts = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                            scale=scaling, enable_gqa=gqa)
             for s, e in itertools.pairwise(cu)]
    return torch.cat(parts, dim=2).transpose(1, 2)


def logprobs(model, mb: dict[str, torch.Tensor], need: torch.Tensor, temperature: float, with_entropy: bool,
             logprob: Callable, keeps_logits: bool = True) -> dict[str, torch.Tensor]:
    """See the module docstring; ``logprob(logits [K, V], target [K], temperature)`` -> ``[K]``."""
    ids, am = mb["input_ids"], mb["attention_mask"].bool()
    b, length = ids.shape
    real = am.reshape(-1).nonzero().squeeze(1)  # flat padded index of each packed token
    lengths = am.sum(1, dtype=torch.int32)
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    positions = (am.long().cumsum(1) - 1).reshape(-1)[real][None]
    # The logits at packed token j score the next token of its sample: keep j where that one is needed.
    scores_next = F.pad(need[:, 1:] & am[:, 1:], (0, 1), value=False).reshape(-1)[real]
    keep = scores_next.nonzero().squeeze(1)
    dummy = keep.numel() == 0  # nothing needed: one head row anyway, so every weight has a gradient
    if dummy:
        keep = keep.new_zeros(1)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(lengths.max()),
              "max_length_k": int(lengths.max())}
    if keeps_logits:
        kwargs["logits_to_keep"] = keep
    logits = model(input_ids=ids.reshape(-1)[real][None], position_ids=positions, attention_mask=None,
                   use_cache=False, **kwargs).logits[0]
    if not keeps_logits:
        logits = logits[keep]
    dest = real[keep] + 1  # the padded position of the token those logits score
    target = ids.reshape(-1)[dest.clamp(max=b * length - 1)]
    if dummy:
        target = torch.full_like(target, -1)
    lp = logprob(logits, target, temperature)
    out = {"logprobs": _scatter(lp, dest, b, length, dummy)}
    if with_entropy:
        scores = logits.float() / temperature
        lse = torch.logsumexp(scores, dim=-1)
        entropy = lse - (torch.softmax(scores, dim=-1) * scores).sum(-1)
        out["entropy"] = _scatter(entropy, dest, b, length, dummy)
    return out


def _scatter(values: torch.Tensor, dest: torch.Tensor, b: int, length: int, dummy: bool) -> torch.Tensor:
    zeros = values.new_zeros(b * length, dtype=torch.float32)
    if dummy:  # kept in the graph at weight 0
        return (zeros + 0.0 * values.float().sum()).view(b, length)
    return zeros.index_put((dest,), values.float()).view(b, length)
