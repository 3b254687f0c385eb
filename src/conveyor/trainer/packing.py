"""Packed sequences: a micro-batch's samples as one row, without padding.

Packed, the samples' real tokens sit end to end in one ``[1, T]`` row, each sample attends only
to itself (variable-length attention), and the head runs only over the positions whose next
token is wanted. Values and gradients equal the padded forward's to float rounding (tested).
- ``wanted`` / ``enable``: whether ``trainer.pack_sequences`` packs here; ``install(model)``
  registers the ``conveyor_varlen`` attention.
- ``plan`` / ``plan_shared`` and ``micro_batches``: the micro-batch plan; ``Layout``: where each
  token sits packed (``shared_of``: equal prompts share one copy).
- ``logprobs(model, input_ids, layout, ...)``: the ``LossOutputs`` of ``trainer/api.py`` in the
  padded layout.

It knows nothing of losses, optimizers or where the batch came from.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from conveyor.trainer.api import LossOutputs
from conveyor.trainer.microbatch import plan_microbatches

NAME = "conveyor_varlen"
MODES = ("auto", "on", "off", "shared")


def plan(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so each group's summed length is within ``max_tokens``.

    >>> plan([3, 5, 2, 5], 10)
    [[1, 3], [0, 2]]

    ``plan(lengths, max_tokens)``: sample indices in groups whose summed
    length fits ``max_tokens`` (first fit, longest first; a longer sample
    alone), covering every sample once.
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
    """torch's variable-length flash attention, called straight into aten where it can be
    (``kernels/flash_varlen.py``: the same kernels without the custom op's host time)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    from conveyor.trainer.kernels import flash_varlen
    return flash_varlen.varlen_attn if flash_varlen.available() else varlen_attn


def wanted(mode: str, device: torch.device, compiled: bool) -> bool:
    """Whether to pack: ``mode`` is ``trainer.pack_sequences``.

    A padded micro-batch spends compute on padding (a sixth to a fifth of the tokens
    at a 16k-token budget with heavy-tail lengths) and runs the vocabulary head
    over every position. Packed, the samples' real tokens sit end to end in one
    ``[1, T]`` row, each sample attends only to itself (variable-length
    attention), and the head runs only over the positions whose next token is
    wanted. Values and gradients equal the padded forward's to float rounding
    (tested).

    ``wanted(mode, device, compiled)``: whether ``trainer.pack_sequences`` packs here
    (``auto``: on a GPU whose torch has variable-length flash attention).
    """
    if mode not in MODES:
        raise ValueError(f"trainer.pack_sequences={mode!r}; use auto, on, shared or off")
    if mode in ("on", "shared") and compiled:
        raise ValueError(f"trainer.pack_sequences={mode} does not combine with trainer.compile=true; "
                         "set one of them off")
    if mode == "auto":
        return device.type == "cuda" and _flash_varlen() is not None and not compiled
    return mode in ("on", "shared")


def install(model: torch.nn.Module) -> None:
    """Register the packed attention and make ``model`` use it (in place).

    ``install(model)`` registers the ``conveyor_varlen`` attention with
    Hugging Face and switches ``model`` to it. Called with ``cu_seq_lens_q``
    (a packed forward), it runs flash variable-length attention on CUDA in
    bf16/fp16 and a causal attention per sample elsewhere (CPU, float32);
    called without (a padded forward), it is plain causal SDPA, which is exact
    for the real tokens of right-padded rows.
    """
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
              cu_seq_lens_q=None, max_length_q=None, conveyor_groups=None, **kwargs):
    """Hugging Face's attention signature: ``[1, H, T, D]`` q/k/v in, ``[1, T, H, D]`` out."""
    if conveyor_groups is not None:  # prompts shared: each group's branches attend to its prefix
        if dropout:
            raise ValueError("trainer.pack_sequences=shared: attention dropout is not supported; "
                             "set trainer.pack_sequences=off")
        return _shared(query, key, value, conveyor_groups, scaling), None
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError("trainer.pack_sequences: attention dropout is not supported packed; "
                         "set trainer.pack_sequences=off")
    flash = _flash_varlen()
    if flash is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        # squeeze, not x[0]: a select's backward writes zeros of the whole input and copies the gradient
        # into them (24 ms of a 0.5B step on an H200); a squeeze's is a view
        q, k, v = (x.squeeze(0).transpose(0, 1).contiguous() for x in (query, key, value))  # [T, heads, D]
        return _flash(flash, q, k, v, cu_seq_lens_q, int(max_length_q), scaling)[None], None
    return _per_sample(query, key, value, cu_seq_lens_q.tolist(), scaling), None


_NATIVE_GQA: dict[str, bool] = {}  # whether this torch's flash kernel took fewer kv heads (first call)


def _flash(flash: Callable, q, k, v, cu, max_len: int, scaling) -> torch.Tensor:
    call = functools.partial(flash, cu_seq_q=cu, cu_seq_k=cu, max_q=max_len, max_k=max_len, scale=scaling,
                             window_size=(-1, 0))  # (-1, 0): causal
    if k.shape[1] == q.shape[1]:
        return call(q, k, v)
    if _NATIVE_GQA.get("ok", True):  # flash attention shares each kv head with its group of q heads
        try:
            out = call(q, k, v, **({"enable_gqa": True} if "enable_gqa" in _parameters(flash) else {}))
            _NATIVE_GQA["ok"] = True
            return out
        except (RuntimeError, TypeError):
            _NATIVE_GQA["ok"] = False
    group = q.shape[1] // k.shape[1]
    return call(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


@functools.cache
def _parameters(fn: Callable) -> frozenset[str]:
    import inspect
    return frozenset(inspect.signature(fn).parameters)


def _segments(query, key, value, sizes: list[int], calls: list[dict]) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on consecutive segments of the packed row (``sizes``
    along the token axis, ``calls[i]`` the keyword arguments of segment i), ``[1, T, H, D]`` out.

    The row is split once (``torch.split``: its backward is one concatenation, where a slice per
    segment made a zero gradient of the whole row for each). On a CPU the scores are computed
    in float32, cast once for the row (bf16 autocast or bf16 / fp16 inputs would run torch's CPU
    kernels in half precision, twice as slow for a SmolLM2 group of 142 tokens, forward and
    backward: 3.05 against 1.50 ms with the conversions, 2-core AMD EPYC, and less exact)."""
    dtype = query.dtype
    cpu = query.device.type == "cpu"
    with torch.autocast("cpu", enabled=False) if cpu else contextlib.nullcontext():
        if cpu:
            query, key, value = query.float(), key.float(), value.float()
        parts = [F.scaled_dot_product_attention(q, k, v, **kw)
                 for q, k, v, kw in zip(query.split(sizes, dim=2), key.split(sizes, dim=2),
                                        value.split(sizes, dim=2), calls)]
        out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return out.to(dtype).transpose(1, 2)


def _per_sample(query, key, value, cu: list[int], scaling) -> torch.Tensor:
    gqa = key.shape[1] != query.shape[1]
    sizes = [e - s for s, e in itertools.pairwise(cu)]
    return _segments(query, key, value, sizes, [dict(is_causal=True, scale=scaling, enable_gqa=gqa)] * len(sizes))


@dataclass(frozen=True)
class Group:
    """A segment of the packed row from ``start``: a shared prompt of ``prefix`` tokens followed by
    each branch's own tokens, or (no branches) one sample's ``prefix`` tokens alone, causal."""
    start: int
    prefix: int
    branches: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.prefix + sum(self.branches)

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[size, size]`` bool: the prefix causal, each branch the whole prefix and itself causally."""
        return _branch_mask(self.prefix, self.branches, str(device))


@functools.lru_cache(maxsize=256)  # every layer of a forward asks for the same masks
def _branch_mask(prefix: int, branches: tuple[int, ...], device: str) -> torch.Tensor:
    n = prefix + sum(branches)
    own = torch.zeros(n, dtype=torch.long)  # 0: the prefix, i: branch i
    own[prefix:] = torch.repeat_interleave(torch.arange(1, len(branches) + 1), torch.tensor(branches, dtype=torch.long))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (causal & ((own[:, None] == own[None, :]) | (own[None, :] == 0))).to(device)


def _shared(query, key, value, groups: tuple[Group, ...], scaling) -> torch.Tensor:
    gqa = key.shape[1] != query.shape[1]
    calls = []
    for g in groups:
        mask = g.mask(query.device) if g.branches else None  # no branches: a causal segment
        calls.append(dict(attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa))
    return _segments(query, key, value, [g.size for g in groups], calls)  # the groups cover the row


def prompt_keys(input_ids: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> list[tuple[bytes, int]]:
    """Per sample: its prompt (the tokens before its first loss token) as bytes, and its length."""
    keys = []
    for ids, lm in zip(input_ids, loss_masks):
        nz = (lm > 0).nonzero()
        n = int(nz[0]) if nz.numel() else int(ids.numel())
        keys.append((ids[:n].to(torch.int64).numpy().tobytes(), n))
    return keys


def plan_shared(lengths: list[int], keys: list[tuple[bytes, int]], max_tokens: int) -> list[list[int]]:
    """``plan`` for shared prompts: the samples of one prompt stay together (their prompt counted
    once) where they fit ``max_tokens``, else in as few pieces as fit; pieces first fit, largest first."""
    by_key: dict[tuple[bytes, int], list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    units: list[tuple[int, list[int]]] = []  # (packed tokens, samples)
    for (_, p), idx in by_key.items():
        piece, cost = [], p
        for i in sorted(idx, key=lambda i: -lengths[i]):
            if piece and cost + lengths[i] - p > max_tokens:
                units.append((cost, piece))
                piece, cost = [], p
            piece.append(i)
            cost += lengths[i] - p
        units.append((cost, piece))
    order = plan([c for c, _ in units], max_tokens)
    return [[i for u in grp for i in units[u][1]] for grp in order]


@dataclass(frozen=True)
class Layout:
    """Where a right-padded ``[b, L]`` micro-batch's tokens sit packed, and which rows the head runs on.

    Built from host tensors before the micro-batch goes to the device (``of``), so a packed
    forward never waits on the device for its own shape.

    - ``Layout.of(attention_mask, need)`` (host tensors, ``[b, L]``, right-padded;
      ``need`` marks the tokens to score) says where each token sits packed and
      which rows the head runs on; ``layout.to(device)`` moves it.
    - ``Layout.shared_of(attention_mask, need, input_ids, loss_mask)`` (``pack_sequences:
      shared``): rows with equal prompts (``prompt_keys``: the tokens before the first loss
      token) share one copy of the prompt, each row's rest a branch attending to it (``Group``,
      a masked attention per group); ``plan_shared`` keeps a prompt's rows in one micro-batch.
    """

    real: torch.Tensor       # [T] flat padded index of each packed token
    cu: torch.Tensor         # [n + 1] int32 sample boundaries in the packed row
    positions: torch.Tensor  # [1, T] each token's position within its sample
    keep: torch.Tensor       # [K] packed rows whose logits score a wanted token
    dest: torch.Tensor       # [K] flat padded index of the token each kept row scores
    max_len: int
    shape: tuple[int, int]   # (b, L)
    scored: bool             # False: nothing wanted; one weight-0 head row keeps every weight in the graph
    groups: tuple[Group, ...] | None = None  # prompts shared (``shared_of``); None: one segment per sample

    @classmethod
    def of(cls, attention_mask: torch.Tensor, need: torch.Tensor) -> Layout:
        am = attention_mask.bool()
        b, length = am.shape
        real = am.reshape(-1).nonzero().squeeze(1)
        lengths = am.sum(1, dtype=torch.int32)
        # The logits at packed token j score its sample's next token: keep j where that one is needed.
        wanted = F.pad(need.bool()[:, 1:] & am[:, 1:], (0, 1), value=False).reshape(-1)[real]
        keep = wanted.nonzero().squeeze(1)
        scored = keep.numel() > 0
        keep = keep if scored else keep.new_zeros(1)
        dest = (real[keep] + 1).clamp(max=b * length - 1)
        return cls(real, F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)),
                   (am.long().cumsum(1) - 1).reshape(-1)[real][None], keep, dest,
                   int(lengths.max()) if b else 0, (b, length), scored)

    @classmethod
    def shared_of(cls, attention_mask: torch.Tensor, need: torch.Tensor, input_ids: torch.Tensor,
                  loss_mask: torch.Tensor) -> Layout:
        """``of`` with each prompt once: rows whose prompts (``prompt_keys``: the tokens before the
        first loss token) are equal share one copy of them (the prefix), and each row's remaining
        tokens follow as a branch that attends to the prefix and to itself. The logits at a prefix
        token score that token's successor in every row of the group (the prefix's last one scores
        each branch's first token)."""
        am = attention_mask.bool()
        b, length = am.shape
        lengths = am.sum(1).tolist()
        keys = prompt_keys([input_ids[i, :n] for i, n in enumerate(lengths)],
                           [loss_mask[i, :n] for i, n in enumerate(lengths)])
        members: dict[tuple[bytes, int], list[int]] = {}
        for i, key in enumerate(keys):
            members.setdefault(key, []).append(i)
        row = torch.full((b, length), -1, dtype=torch.long)  # packed row of each (sample, position)
        real, positions, groups, at = [], [], [], 0

        def put(i: int, lo: int, hi: int) -> None:  # sample i's positions lo..hi-1, next in the row
            nonlocal at
            row[i, lo:hi] = torch.arange(at, at + hi - lo)
            real.append(i * length + torch.arange(lo, hi))
            positions.append(torch.arange(lo, hi))
            at += hi - lo

        for (_, p), idx in members.items():
            if len(idx) == 1 or p == 0:  # nothing to share: each sample its own causal segment
                for i in idx:
                    groups.append(Group(at, lengths[i], ()))
                    put(i, 0, lengths[i])
                continue
            start = at
            put(idx[0], 0, p)
            row[idx[1:], :p] = row[idx[0], :p]
            for i in idx:
                put(i, p, lengths[i])
            groups.append(Group(start, p, tuple(lengths[i] - p for i in idx)))
        wanted = F.pad(need.bool()[:, 1:] & am[:, 1:], (0, 1), value=False) & am
        src = wanted.nonzero()  # (sample, position) whose logits score the next token
        keep = row[src[:, 0], src[:, 1]]
        dest = src[:, 0] * length + src[:, 1] + 1
        scored = keep.numel() > 0
        if not scored:
            keep, dest = keep.new_zeros(1), dest.new_zeros(1)
        cu = torch.tensor([0] + [g.start + g.size for g in groups], dtype=torch.int32)
        flat = torch.cat(real) if real else torch.zeros(0, dtype=torch.long)
        pos = torch.cat(positions)[None] if positions else torch.zeros(1, 0, dtype=torch.long)
        return cls(flat, cu, pos, keep, dest, int(max(lengths, default=0)), (b, length), scored, tuple(groups))

    def to(self, device: torch.device) -> Layout:
        move = {k: getattr(self, k).to(device, non_blocking=True) for k in ("real", "cu", "positions", "keep", "dest")}
        return replace(self, **move)


def logprobs(model, input_ids: torch.Tensor, layout: Layout, temperature: float, with_entropy: bool,
             logprob: Callable, keeps_logits: bool = True) -> LossOutputs:
    """The padded ``input_ids`` forwarded packed; ``logprob(logits [K, V], target [K], temperature)`` -> ``[K]``.

    ``logprobs(model, input_ids, layout, temperature, with_entropy, logprob)``:
    the padded ``input_ids`` forwarded packed; returns the ``LossOutputs`` of ``trainer/api.py``:
    ``[b, L]`` float32 logprobs (and entropy) where ``need`` was set and 0.0 elsewhere, in the
    padded layout.
    """
    kwargs = {"cu_seq_lens_q": layout.cu, "cu_seq_lens_k": layout.cu, "max_length_q": layout.max_len,
              "max_length_k": layout.max_len}
    if layout.groups is not None:
        kwargs["conveyor_groups"] = layout.groups
    if keeps_logits:
        kwargs["logits_to_keep"] = layout.keep
    flat = input_ids.reshape(-1)
    logits = model(input_ids=flat[layout.real][None], position_ids=layout.positions, attention_mask=None,
                   use_cache=False, **kwargs).logits.squeeze(0)  # a view's backward, not a select's
    if not keeps_logits:
        logits = logits[layout.keep]
    target = flat[layout.dest] if layout.scored else torch.full_like(layout.dest, -1)
    out = LossOutputs(_scatter(logprob(logits, target, temperature), layout))
    if with_entropy:
        scores = logits.float() / temperature
        lse = torch.logsumexp(scores, dim=-1)
        out = replace(out, entropy=_scatter(lse - (torch.softmax(scores, dim=-1) * scores).sum(-1), layout))
    return out


def _scatter(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    b, length = layout.shape
    zeros = values.new_zeros(b * length, dtype=torch.float32)
    if not layout.scored:  # kept in the graph at weight 0
        return (zeros + 0.0 * values.float().sum()).view(b, length)
    return zeros.index_put((layout.dest,), values.float()).view(b, length)


def enable(cfg, device: torch.device, models: list) -> bool:
    """Whether ``cfg`` (a ``TrainerConfig``) packs on ``device``; if so the models (None skipped)
    are switched to the packed attention.

    ``enable(cfg, device, models)`` and ``micro_batches(cfg, lengths, packed)``
    are what the trainers call: whether to pack (switching the models), and the
    micro-batch plan (packed here, padded ``microbatch.py`` otherwise).
    """
    if not wanted(cfg.pack_sequences, device, cfg.compile):
        return False
    for m in models:
        if m is not None:
            install(m)
    return True


def micro_batches(cfg, lengths: list[int], packed: bool, budget: int | None = None,
                  keys: list[tuple[bytes, int]] | None = None) -> list[list[int]]:
    """Micro-batches of ``budget`` tokens (default ``cfg.micro_batch_tokens``): real tokens packed
    (each prompt counted once with ``keys``, ``prompt_keys``), padded ones otherwise
    (``microbatch.plan_microbatches``)."""
    budget = budget or cfg.micro_batch_tokens
    if packed and keys is not None:
        return plan_shared(lengths, keys, budget)
    return plan(lengths, budget) if packed else plan_microbatches(lengths, budget, cfg.pad_multiple)
