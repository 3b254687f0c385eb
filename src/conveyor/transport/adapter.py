"""How low-rank adapters travel as weights: names, shapes, and the specs transports stage.

Contract: an adapter-only publish (``trainer.lora.publish=adapter``) carries,
for every adapted linear layer ``X`` (its base-model name, e.g.
``model.layers.0.self_attn.q_proj``), two tensors: ``X.lora_A`` of shape
``[r, in]`` and ``X.lora_B`` of shape ``[out, r]``, with B already scaled by
``alpha / r``, so that the engine serves ``W_X = W0_X + B @ A`` where ``W0_X``
is its own base weight. Nothing else travels: the base weights never change.
``split(name)`` reads such a name back (``None`` for any other name);
``adapter_specs`` lists what a transport stages for a checkpoint and a set of
targets without loading it (the model is built on the meta device).

It knows nothing of peft, optimizers or how an engine merges.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"


class AdapterName(NamedTuple):
    module: str  # the adapted linear layer's base-model name
    part: str    # "A" or "B"


def split(name: str) -> AdapterName | None:
    for suffix, part in ((A_SUFFIX, "A"), (B_SUFFIX, "B")):
        if name.endswith(suffix):
            return AdapterName(name[: -len(suffix)], part)
    return None


def adapted_linears(model: torch.nn.Module, targets: list[str]) -> list[tuple[str, torch.nn.Linear]]:
    """The model's linear layers whose last name component is in ``targets``, in module order."""
    want = set(targets)
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in want]


def adapter_specs(path: str, targets: list[str], rank: int, trust_remote_code: bool = False,
                  dtype: torch.dtype = torch.float32) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor of an adapter-only publish for the checkpoint at ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    out = []
    for name, m in adapted_linears(model, targets):
        out.append((name + A_SUFFIX, (rank, m.in_features), dtype))
        out.append((name + B_SUFFIX, (m.out_features, rank), dtype))
    return out
