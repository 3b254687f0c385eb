"""Low-rank adapters (LoRA, through peft) for the trainers: attach, publish, export.

- ``attach(model, cfg, seed)`` injects peft LoRA layers in place and freezes every other
  parameter; the first policy is the base model, the same on every rank. Missing targets raise
  ``LoraSetupError`` naming them (``check_targets`` / ``check_checkpoint`` before a run starts).
- ``merged`` turns an adapted state dict into the plain model's (``W0 + scaling * B @ A`` in
  float32); ``adapter`` yields only the adapters on the wire names of ``transport/adapter.py``;
  ``published`` picks one by ``cfg.publish``.
- ``write_export``, ``export_model``, ``export_checkpoint``: merged or peft-format exports.

It knows nothing of optimizers, sharding or transports beyond the wire names.
"""
from __future__ import annotations

import math
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from conveyor.config.lora import LoraConfig
from conveyor.transport.adapter import A_SUFFIX, B_SUFFIX

PEFT_A, PEFT_B, PEFT_BASE = ".lora_A.default.weight", ".lora_B.default.weight", ".base_layer."
ADAPTER_DIR = "adapter"  # where a merged export keeps the adapter too
FORMS = ("merged", "adapter")


class LoraSetupError(ValueError):
    """``trainer.lora`` cannot be used: peft is missing, or a target names a layer the model lacks."""


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name components of the model's linear layers (what a target may name)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})


def check_targets(model: nn.Module, targets: list[str]) -> None:
    have = linear_names(model)
    missing = [t for t in targets if t not in have]
    if missing:
        raise LoraSetupError(f"trainer.lora.target_modules: {missing} not in the model; its linear layers are "
                              f"{have}; list some of those")


def check_checkpoint(path: str, cfg: LoraConfig, trust_remote_code: bool = False) -> None:
    """peft importable and ``check_targets`` for the checkpoint at ``path``, built on the meta device
    (nothing loaded)."""
    if not cfg.enabled:
        return
    try:
        import peft  # noqa: F401
    except ImportError:
        raise LoraSetupError("trainer.lora.enabled=true needs peft: pip install 'conveyor[lora]'") from None
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    check_targets(model, list(cfg.target_modules))


def scaling(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.rank


def peft_config(cfg: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), init_lora_weights=True)


def attach(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> nn.Module:
    """Inject the adapters into ``model`` in place; returns it.

    ``attach(model, cfg, seed)`` injects peft LoRA layers into ``model`` in place
    (``trainer.lora``: rank, alpha, dropout, target modules) and freezes every
    other parameter, so a trainer whose optimizer takes ``requires_grad``
    parameters holds only the adapters. A's init comes from a generator seeded
    with ``seed`` (every FSDP rank and the single-device trainer start from the
    same adapters); B starts at zero, so the first policy is the base model.
    Targets missing from the model raise ``LoraSetupError`` naming them and the
    linear layers the model has (``check_targets``; ``check_checkpoint`` does the
    same for a checkpoint on the meta device, and checks that peft is installed,
    before a run starts).
    """
    check_targets(model, list(cfg.target_modules))
    from peft import inject_adapter_in_model
    model = inject_adapter_in_model(peft_config(cfg), model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(PEFT_A):
                # peft's own init draws from the global RNG; ranks must agree without sharing it.
                nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=gen)
            elif name.endswith(PEFT_B):
                p.zero_()
    return model


def is_adapter(name: str) -> bool:
    return name.endswith((PEFT_A, PEFT_B))


def merge(w0: torch.Tensor, b_scaled: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``W0 + B @ A`` in float32 (B already scaled): the one formula the trainer and engine share."""
    return torch.addmm(w0.float(), b_scaled.float(), a.float())


def merged(items: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's tensors from an adapted model's (name, tensor) pairs in state-dict order.

    After ``attach`` the model's state dict names a target ``X`` as
    ``X.base_layer.weight`` / ``X.lora_A.default.weight`` /
    ``X.lora_B.default.weight`` (peft's names). ``merged(items, scaling)`` turns
    such (name, tensor) pairs, in state-dict order, into the plain model's:
    ``X.weight = W0 + scaling * B @ A`` computed in float32, every other tensor
    under its base name. ``adapter(items, scaling)`` yields only the adapters on
    the wire names of ``transport/adapter.py`` (B pre-scaled). ``published``
    picks one by ``cfg.publish``.
    """
    base: dict[str, torch.Tensor] = {}
    a: dict[str, torch.Tensor] = {}
    for name, t in items:
        if name.endswith(PEFT_A):
            a[name[: -len(PEFT_A)]] = t
        elif name.endswith(PEFT_B):
            module = name[: -len(PEFT_B)]
            yield module + ".weight", merge(base.pop(module), t.float() * scale, a.pop(module))
        elif name.endswith(PEFT_BASE + "weight"):
            base[name[: -len(PEFT_BASE + "weight")]] = t
        else:
            yield name.replace(PEFT_BASE, "."), t
    if base or a:
        raise ValueError(f"LoRA merge: adapted layers without their adapters: {sorted(base) or sorted(a)}")


def adapter(items: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the adapters, on the wire names (``transport/adapter.py``), B scaled."""
    for name, t in items:
        if name.endswith(PEFT_A):
            yield name[: -len(PEFT_A)] + A_SUFFIX, t
        elif name.endswith(PEFT_B):
            yield name[: -len(PEFT_B)] + B_SUFFIX, t.float() * scale


def published(items: Iterable[tuple[str, torch.Tensor]], cfg: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    return (adapter if cfg.publish == "adapter" else merged)(items, scaling(cfg))


def peft_state(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapters under peft's saved names (B not scaled: peft scales when it loads)."""
    out = {}
    for name, t in items:
        for suffix, part in ((PEFT_A, "lora_A"), (PEFT_B, "lora_B")):
            if name.endswith(suffix):
                out[f"base_model.model.{name[: -len(suffix)]}.{part}.weight"] = t.detach().cpu().contiguous()
    return out


def save_adapter(state: dict[str, torch.Tensor], cfg: LoraConfig, out: Path, base: str | None = None) -> None:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    pc = peft_config(cfg)
    pc.base_model_name_or_path = base
    pc.save_pretrained(str(out))
    save_file(peft_state(state.items()), str(out / "adapter_model.safetensors"))


def write_export(state: dict[str, torch.Tensor], cfg: LoraConfig, out: Path, form: str) -> None:
    """Write an adapted model's full state dict (peft names) into ``out``: ``merged`` the plain
    weights (the caller writes config and tokenizer files) and the adapter in ``out/adapter``,
    ``adapter`` the adapter alone (peft's format).

    ``write_export(state, cfg, out, form)``: ``merged`` writes the plain HF
    weights with the adapter beside them in ``out/adapter``; ``adapter`` writes
    only peft's format (``adapter_config.json`` + ``adapter_model.safetensors``),
    loadable with ``peft.PeftModel.from_pretrained(base, out)``.
    ``export_model`` is a single-device trainer's merged export (config and
    tokenizer files included); ``export_checkpoint`` turns a LoRA run's
    checkpoint (peft's names; plain or sharded) into either form.
    """
    from conveyor.trainer.checkpoint import save_hf_weights
    if form not in FORMS:
        raise ValueError(f"export form {form!r}: use one of {', '.join(FORMS)}")
    if form == "adapter":
        save_adapter(state, cfg, out)
        return
    plain = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in merged(state.items(), scaling(cfg))}
    save_hf_weights(plain, out)
    save_adapter(state, cfg, out / ADAPTER_DIR)


def export_model(model: nn.Module, cfg: LoraConfig, out: str | Path, source_dir: Path | None) -> None:
    """A single-process trainer's adapted ``model`` as a merged HF checkpoint (atomically)."""
    from conveyor.trainer.checkpoint import _atomic_dir, copy_tokenizer_files
    with _atomic_dir(out) as tmp:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        copy_tokenizer_files(source_dir, tmp)
        write_export(model.state_dict(), cfg, tmp, "merged")


def is_adapted(state_names: Iterable[str]) -> bool:
    return any(is_adapter(n) for n in state_names)


def export_checkpoint(ckpt: Path, out: Path, cfg: LoraConfig, form: str) -> None:
    """A LoRA run's checkpoint (``ckpt/policy`` in peft's names, or sharded ``ckpt/dcp``) written
    to ``out`` (atomically) as the merged HF checkpoint or the adapter alone."""
    from conveyor.trainer import checkpoint as ck
    policy = ckpt / "policy"
    sharded = (ckpt / ck.SHARDED_MARKER).is_file()
    state = ck.read_sharded_policy(ckpt) if sharded else ck._read_policy_tensors(policy)
    if not is_adapted(state):
        raise ValueError(f"{ckpt} holds no LoRA adapter (no *.lora_A.default.weight); export it without --form")
    with ck._atomic_dir(out) as tmp:
        if form == "merged":  # config, generation config and tokenizer files; the weights come merged
            for item in policy.iterdir():
                if item.is_file() and not item.name.startswith("model"):  # model*.safetensors(.index.json)
                    shutil.copy2(item, tmp / item.name)
        write_export(state, cfg, tmp, form)
