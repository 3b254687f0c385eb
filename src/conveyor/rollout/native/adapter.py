"""Adapter-only weight updates in the native engine: ``W = W0 + B @ A`` over its own base weights.

Contract: ``is_adapter_tensor(name)`` tells an adapter's tensor from a weight's.
``AdapterMerge(targets)``: ``plan(named)`` checks every pair of an update before anything
changes, so a bad update changes nothing; ``apply(plan)`` sets each adapted weight to
``W0 + B @ A`` in place, where ``W0`` is the weight's own copy, so each version's delta replaces
the previous one exactly.

It knows nothing of peft, trainers or transports.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.transport.adapter import A_SUFFIX, B_SUFFIX, split


def is_adapter_tensor(name: str) -> bool:
    return name.endswith((A_SUFFIX, B_SUFFIX))


@dataclass(frozen=True)
class AdapterPair:
    weight: str          # the adapted parameter's name (``X.weight``)
    a: torch.Tensor      # [r, in]
    b: torch.Tensor      # [out, r], scaled


class AdapterMerge:
    """``AdapterMerge(targets)`` over the engine's name -> parameter map.
    ``plan(named)`` takes the adapter tensors of one update (wire names of
    ``transport/adapter.py``: ``X.lora_A`` ``[r, in]``, ``X.lora_B`` ``[out, r]``,
    B already scaled) and checks every pair (both halves present, ``X.weight`` a
    parameter of the engine, shapes that fit) before anything changes, so a bad
    update changes nothing. ``apply(plan)`` (under the engine's step lock) sets
    every adapted weight to ``W0 + B @ A``, computed in float32 and written in
    place in the weight's dtype. ``W0`` is a copy of the weight taken the first
    time an adapter reaches it, so each version's delta replaces the previous one
    exactly instead of piling onto it; ``rebase(name)`` drops that copy when a full
    tensor arrives for the weight (it is the new base). The copies cost the
    adapted weights' memory once, in the engine's dtype.
    """
    def __init__(self, targets: dict[str, torch.Tensor]):
        self.targets = targets
        self.base: dict[str, torch.Tensor] = {}  # weight name -> W0, taken on its first adapter

    def plan(self, named: list[tuple[str, torch.Tensor]]) -> list[AdapterPair]:
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in named:
            parsed = split(name)
            if parsed is None:
                raise ValueError(f"update_weights: {name!r} is not an adapter tensor (X.lora_A / X.lora_B)")
            halves.setdefault(parsed.module, {})[parsed.part] = t
        pairs = []
        for module, parts in halves.items():
            weight = module + ".weight"
            target = self.targets.get(weight)
            if target is None or set(parts) != {"A", "B"}:
                raise ValueError(f"update_weights: adapter of {module!r} needs {weight!r} in the model and both "
                                 f"lora_A and lora_B (got {sorted(parts)}); send a whole adapter of this model")
            a, b = parts["A"], parts["B"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or \
                    (b.shape[0], a.shape[1]) != tuple(target.shape):
                raise ValueError(f"update_weights: adapter of {module!r} has A {tuple(a.shape)} and B "
                                 f"{tuple(b.shape)}, which do not make {tuple(target.shape)}")
            pairs.append(AdapterPair(weight, a, b))
        return pairs

    @torch.no_grad()
    def apply(self, pairs: list[AdapterPair]) -> None:
        for p in pairs:
            target = self.targets[p.weight]
            w0 = self.base.get(p.weight)
            if w0 is None:
                w0 = self.base[p.weight] = target.detach().clone()
            a, b = p.a.to(target.device), p.b.to(target.device)
            # The trainer's merged publish computes the same float32 addmm (trainer/lora.py, merge).
            target.copy_(torch.addmm(w0.float(), b.float(), a.float()))

    def rebase(self, weight: str) -> None:
        self.base.pop(weight, None)
