"""Token-budget micro-batching: which samples share a forward pass, and padding.

- ``plan_microbatches(lengths, max_tokens, multiple=1)``: groups covering every sample exactly
  once, by padded cost; a sequence longer than the budget gets a group of its own (never dropped).
- ``balance`` deals samples to data-parallel ranks by tokens; ``split_even`` cuts mini-batches;
  ``live_samples`` leaves out what the loss marks inert.
- ``collate(batch, idx, pad_id, multiple=1)`` right-pads samples into a ``LossInputs``.
All deterministic.

This module does not know what the tensors are for, which device they go to
or how a loss normalises; it only groups and pads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.trainer.api import LossFn, LossInputs
from conveyor.types import BATCH_FIELDS, COLLATED

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.types import Batch


def padded(length: int, multiple: int = 1) -> int:
    return -(-length // multiple) * multiple


def plan_microbatches(lengths: list[int], max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Group sample indices so each group's padded size fits ``max_tokens``.

    >>> plan_microbatches([3, 5, 2, 5], 10)
    [[1, 3], [0, 2]]

    ``plan_microbatches(lengths, max_tokens, multiple=1)`` returns lists of
    sample indices (into ``lengths``) that together cover every sample exactly
    once. Samples are taken longest first (ties by index, so the plan is
    deterministic) and a micro-batch grows while its PADDED cost
    ``(count + 1) * max_len`` stays within ``max_tokens``; ``max_len`` is the
    first (longest) member's length rounded up to ``multiple``.
    A single sequence longer than the budget gets a micro-batch of its own: it
    is never dropped or truncated, so the budget is a target, not a hard cap.
    """
    if max_tokens < 1:
        raise ValueError(f"plan_microbatches: max_tokens must be >= 1, got {max_tokens}")
    # Longest first keeps similar lengths together, which minimises padding;
    # the index tie-break makes the plan independent of sort stability.
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * padded(lengths[current[0]], multiple) > max_tokens:
            plan.append(current)
            current = []
        current.append(i)
    if current:
        plan.append(current)
    return plan


def _pad(seqs: list[torch.Tensor], length: int, value: float | int) -> torch.Tensor:
    out = torch.full((len(seqs), length), value, dtype=seqs[0].dtype)
    for row, s in enumerate(seqs):
        out[row, : s.numel()] = s
    return out


def _check_aligned(batch: "Batch", idx: list[int]) -> None:
    # A misaligned field would silently shift advantages against tokens, so
    # fail loudly here, where the sample index is still known.
    for i in idx:
        n = batch.input_ids[i].numel()
        named = [("loss_mask", batch.loss_mask[i])] + [(k, v[i]) for k, v in batch.fields.items()]
        for name, t in named:
            if t.numel() != n:
                raise ValueError(
                    f"Batch sample {i}: {name} has {t.numel()} entries but input_ids has {n}; "
                    "every field must be aligned with input_ids")


def collate(batch: "Batch", idx: list[int], pad_id: int, multiple: int = 1) -> LossInputs:
    """Right-pad samples ``idx`` of ``batch`` into ``[len(idx), max_len]`` tensors (on CPU).

    ``collate(batch, idx, pad_id, multiple=1)`` right-pads the selected samples
    into the ``[b, L]`` tensors of a ``LossInputs``, L the longest rounded up to
    ``multiple`` (few distinct shapes let per-shape work — attention plans, allocator
    blocks — be reused from step to step): ``input_ids`` (pad ``pad_id``), ``attention_mask``
    (1 on real tokens), ``loss_mask`` (float, 0 on padding) and every field of the
    batch under its own name, custom ones in ``custom`` (0 on padding, dtype kept), and with
    ``Batch.routes`` ``routes`` ``[b, L, layers, k]`` (-1, "the router's own choice",
    wherever a sample recorded none: padding, positions past its record).
    """
    if not idx:
        raise ValueError("collate: idx is empty; a micro-batch needs at least one sample")
    _check_aligned(batch, idx)
    ids = [batch.input_ids[i].reshape(-1).long() for i in idx]
    length = padded(max(s.numel() for s in ids), multiple)

    def pad(rows: list[torch.Tensor]) -> torch.Tensor:
        return _pad([rows[i].reshape(-1) for i in idx], length, 0)
    for name in batch.custom:
        if name in COLLATED:
            raise ValueError(f"Batch field {name!r} clashes with a collated tensor; rename the field")
    return LossInputs(
        input_ids=_pad(ids, length, pad_id),
        attention_mask=_pad([torch.ones_like(s) for s in ids], length, 0),
        loss_mask=_pad([batch.loss_mask[i].reshape(-1).float() for i in idx], length, 0.0),
        routes=None if batch.routes is None else _pad_routes([batch.routes[i] for i in idx], length),
        custom={name: pad(rows) for name, rows in batch.custom.items()},
        **{name: pad(rows) for name in BATCH_FIELDS if (rows := getattr(batch, name)) is not None})


def _pad_routes(routes: list[torch.Tensor], length: int) -> torch.Tensor:
    out = torch.full((len(routes), length, *routes[0].shape[1:]), -1, dtype=torch.long)
    for row, r in enumerate(routes):
        if r.shape[0] > length:
            raise ValueError(f"Batch routes: {r.shape[0]} recorded positions for a sample of at most {length} "
                             "tokens; routes must not run past the sample")
        out[row, : r.shape[0]] = r
    return out


def balance(lengths: list[int], world: int, keys: list[tuple[bytes, int]] | None = None) -> list[list[int]]:
    """Deal sample indices to ``world`` ranks by tokens: longest first onto the least-loaded rank.

    With ``keys`` (per sample its prompt's tokens and length, ``packing.prompt_keys``)
    the unit dealt is a prompt's group, costing its prompt once plus each sample's tokens after
    it, so a rank that packs prompts computes each of its prompts once. With fewer groups than
    ranks it deals samples, so no rank is left idle. Deterministic (ties go to the lower index
    and rank), so every rank computes every rank's share without communicating.

    ``balance(lengths, world, keys=None)`` deals sample indices to ``world``
    data-parallel ranks by tokens, before each rank plans its own micro-batches;
    with ``keys`` (each sample's prompt, ``pack_sequences: shared``) a prompt's
    samples go to one rank together, so its prompt is computed once, not once per rank.
    """
    units: list[tuple[int, list[int]]]  # (tokens, samples)
    by_key: dict[tuple[bytes, int], list[int]] = {}
    for i, k in enumerate(keys or ()):
        by_key.setdefault(k, []).append(i)
    if keys is not None and len(by_key) >= world:
        units = [(p + sum(lengths[i] - p for i in idx), idx) for (_, p), idx in by_key.items()]
    else:
        units = [(n, [i]) for i, n in enumerate(lengths)]
    loads, shares = [0] * world, [[] for _ in range(world)]
    for cost, idx in sorted(units, key=lambda u: (-u[0], u[1][0])):
        r = min(range(world), key=lambda r: (loads[r], r))
        shares[r].extend(idx)
        loads[r] += cost
    return shares


def live_samples(batch: "Batch", loss_fn: LossFn) -> list[int]:
    """Indices of ``batch``'s samples whose loss terms may be nonzero.

    ``live_samples(batch, loss_fn)``: the indices of the samples to compute, all
    but those the loss's ``inert(batch)`` marks (``LossFn`` in api.py).
    """
    return [i for i, d in enumerate(loss_fn.inert(batch)) if not d]


def split_even(n: int, parts: int) -> list[list[int]]:
    """Indices 0..n-1 in ``parts`` consecutive runs whose sizes differ by at most one (mini-batches).

    ``split_even(n, parts)`` cuts a batch into ``parts`` mini-batches of nearly
    equal size (in order).
    """
    if parts > n:
        raise ValueError(f"trainer.mini_batches={parts} exceeds the batch's {n} samples; lower trainer.mini_batches")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out
