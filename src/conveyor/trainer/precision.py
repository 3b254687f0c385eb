"""Mixed precision for the trainers: which dtype forward and backward run in, and the
single-device trainer's low-precision copy of the linear weights.

On a GPU the trainers compute what float32 weights under bf16 autocast compute:
every linear layer sees bf16 weights and inputs, while embeddings, norms, biases
and the residual stream stay float32. ``LocalTrainer`` holds the linear weights
as bf16 copies of the float32 masters (refreshed after every optimizer step, so
autocast has no weight to cast), ``FSDPTrainer`` gathers them in bf16. Embeddings
and norms stay float32 because bf16 there learns less (docs/architecture.md,
"Choices measured").
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from conveyor.config import TrainerConfig
from conveyor.runtime.devices import native_dtype


def compute_dtype(cfg: TrainerConfig, device: torch.device) -> torch.dtype:
    if cfg.param_dtype == "auto" or (cfg.param_dtype == "native" and device.type == "cuda"):
        return torch.bfloat16 if device.type == "cuda" and cfg.autocast_bf16 else torch.float32
    if cfg.param_dtype == "native":
        return getattr(torch, native_dtype(device)[0])
    return getattr(torch, cfg.param_dtype)


def linear_copy(model: nn.Module, dtype: torch.dtype) -> tuple[nn.Module, list]:
    """``model`` with the weights of its linear layers as ``dtype`` copies, each feeding its
    gradient to its master, and every other tensor shared with ``model``. A weight tied to an
    embedding stays shared: autocast casts it for the head and the lookup stays float32."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)} - embedded
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in linear}
    compute = copy.deepcopy(model, memo)  # memo entries are reused, not copied
    copies = []
    for w, m in zip(compute.parameters(), model.parameters()):
        if id(m) in linear:
            w.data = w.data.to(dtype)
            if m.requires_grad:
                w.register_post_accumulate_grad_hook(functools.partial(_into_master, m))
            copies.append((w, m))
    return compute, copies


def _into_master(master: nn.Parameter, param: nn.Parameter) -> None:
    """Post-accumulate hook of a compute weight: move its gradient into the float32 master's
    (summing micro-batches in float32, not bf16) and free the low-precision one."""
    if master.grad is None:
        master.grad = param.grad.float()
    else:
        master.grad.add_(param.grad)
    param.grad = None
