"""The ``trainer.lora`` section: low-rank adapters trained instead of the full weights.

It only describes the adapters and how their weights reach the engines; the
trainer (``trainer/lora.py``) attaches them and the native engine merges
adapter-only publishes (``rollout/native/adapter.py``). No torch here.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from conveyor.config.base import _Section

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(_Section):
    enabled: bool = Field(False, description=(
        "train low-rank adapters (LoRA, with peft) on the target modules instead of every weight; the "
        "optimizer then holds only the adapters and the base weights never change"))
    rank: int = Field(16, ge=1, description="adapter rank r: each target W (out x in) learns B (out x r) @ A (r x in)")
    alpha: float = Field(32.0, gt=0, description="the adapter's update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGETS), description=(
        "names (last component) of the linear layers that get adapters; the run is refused before it "
        "starts when one does not exist in the model"))
    publish: Literal["merged", "adapter"] = Field("merged", description=(
        "what the engines receive on each version. merged: the trainer merges W + (alpha/rank) B @ A and "
        "publishes full weights under the base names (any engine); adapter: only the A / B tensors travel "
        "and the native engine merges them into its own base weights (rollout.engine=native only)"))

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("list at least one linear layer name, e.g. [q_proj, v_proj]")
        return v
