"""The modules a trainer computes with, built the same way by both trainers.

- ``load_policy(src)``: a checkpoint (float32 master weights) or a torch model as it is.
- ``ValueModel``: the critic, initialised from a private generator (the global RNG untouched).
- ``training_state_bytes(path, cfg)``: the device memory one rank's whole-model trainer keeps,
  computed on the meta device.
- ``decoder_layers``, ``enable_checkpointing``, ``fuse_layers``, ``compile_layers``: in-place
  preparations; names and ``state_dict`` stay unchanged.

It does not know about optimizers, losses, devices beyond the kernels' check,
or how the modules are sharded.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.config import TrainerConfig
from conveyor.trainer.logprobs import kernel_available


class ValueModel(nn.Module):
    """Backbone (decoder without lm_head) + Linear(hidden, 1): one value per position.

    ``ValueModel(backbone, hidden_size, seed)``: the critic, the decoder without
    its head plus ``Linear(hidden, 1)`` initialised from a private generator
    (the global RNG is neither read nor moved), one float32 value per position.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, seed: int = 0):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        # A private generator keeps the head's init independent of (and from
        # disturbing) the global RNG, so runs stay reproducible.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=gen) / math.sqrt(hidden_size))
            self.head.bias.zero_()

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False).last_hidden_state
        return self.head(h).squeeze(-1).float()


def load_policy(src: Any) -> tuple[nn.Module, Path | None]:
    """``load_policy(src)``: a checkpoint directory (loaded with float32 master
    weights, whatever its dtype) or a torch model as it is -> the model and its
    source directory (None when it has none); anything else is a ``TypeError``.
    """
    if isinstance(src, (str, Path)):
        from transformers import AutoModelForCausalLM

        # Master weights stay float32 whatever the checkpoint dtype: AdamW on
        # bf16 weights loses small updates. bf16 comes from autocast instead.
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        return model, Path(src) if Path(src).is_dir() else None
    if not isinstance(src, nn.Module):
        raise TypeError(f"LocalTrainer: expected a checkpoint path or a torch model, got {type(src).__name__}")
    name = getattr(src, "name_or_path", "") or ""
    return src, Path(name) if name and Path(name).is_dir() else None


def training_state_bytes(path: str | Path, cfg: TrainerConfig) -> int:
    """``training_state_bytes(path, cfg)``: the device memory one rank's whole-model
    trainer keeps for the model at ``path`` (built on the meta device, nothing
    loaded): float32 weights, gradients and AdamW's two moments, the bf16 compute
    copy, the reference and the critic ``cfg`` asks for; LoRA trains a few
    adapters on frozen float32 weights. Activations are not counted.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
                     .parameters())
    per_param = 4 if cfg.lora.enabled else 4 + 4 + 8 + 2  # weights (+ gradients, moments, the bf16 copy)
    if cfg.reference:
        per_param += 4
    if cfg.critic:
        per_param += 16
    return params * per_param


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF model (its ``_no_split_modules`` classes), outermost first."""
    names = set().union(*(getattr(m, "_no_split_modules", None) or () for m in module.modules()))
    return [m for m in module.modules() if m is not module and type(m).__name__ in names]


def compile_layers(model: nn.Module) -> None:
    """Compile every decoder layer in place (names and state_dict unchanged). The layers share
    their code, so one compiled graph serves them all; dynamic shapes avoid a recompile per
    micro-batch shape."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def fuse_layers(cfg: TrainerConfig, model: nn.Module, device: torch.device) -> None:
    """Our Triton RMSNorm and SwiGLU in ``model`` when ``cfg.kernels`` on a GPU (not under the
    compiler, which fuses them itself)."""
    if cfg.kernels and not cfg.compile and device.type == "cuda" and kernel_available():
        from conveyor.trainer.kernels.layers import use_fused_layers
        use_fused_layers(model)


def enable_checkpointing(model: nn.Module) -> None:
    """``enable_checkpointing``, ``fuse_layers``, ``compile_layers``: the in-place
    preparations ``trainer.gradient_checkpointing``, ``trainer.kernels`` (on a
    GPU, not under the compiler) and ``trainer.compile`` ask for; names and
    ``state_dict`` stay unchanged.
    """
    kwargs = {"use_reentrant": False}  # the non-reentrant form needs no input that requires grad
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
