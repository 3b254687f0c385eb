"""Refuse, before anything starts, a run that asks for GPUs this machine does not have.

Contract: ``check_devices(cfg, visible_gpus=None)`` raises ``DeviceError``, one
line naming the field and the fix, when ``trainer.device``,
``rollout.device``, (a reward model's) ``reward.device`` or (a judge's)
``reward.judge.device`` names CUDA (or a CUDA index) that is not visible, or when
``launch.placement`` / ``launch.trainer_ranks`` / ``launch.engines`` need more
GPUs than are visible (``placement.plan``'s own check, run early), or when
``rollout.quantization=fp8`` would run on a GPU without FP8 tensor cores. On a
machine without GPUs and with devices left at ``auto``, every placement runs
on CPU and nothing is refused. It starts no process and allocates nothing.
"""
from __future__ import annotations

from conveyor.config import RunConfig


class DeviceError(ValueError):
    """A device or placement this machine cannot provide; the message names the field and the fix."""


def visible_gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_field(field: str, device: str, gpus: int) -> None:
    if not device.startswith("cuda"):
        return
    index = int(device.split(":", 1)[1]) if ":" in device and device.split(":", 1)[1].isdigit() else 0
    if gpus == 0:
        raise DeviceError(f"{field}={device} but this machine has no usable CUDA GPU (torch sees none); "
                          f"set {field}=auto or {field}=cpu")
    if index >= gpus:
        raise DeviceError(f"{field}={device} but only {gpus} CUDA GPU(s) are visible (cuda:0..cuda:{gpus - 1}); "
                          f"set {field}=auto or a visible index")


def _check_fp8(cfg: RunConfig, gpus: int) -> None:
    """FP8 GEMMs need compute capability 8.9+ (Ada, Hopper); the engines' GPUs are this machine's."""
    import torch

    if cfg.rollout.quantization != "fp8" or gpus == 0 or cfg.rollout.device == "cpu" or not torch.cuda.is_available():
        return

    from conveyor.rollout.native.quant import fp8_unsupported_reason
    for index in range(gpus):
        reason = fp8_unsupported_reason(torch.device("cuda", index))
        if reason is not None:
            raise DeviceError(f"rollout.quantization=fp8 but cuda:{index}: {reason}; set "
                              "rollout.quantization=int8 (or none), or run on an H100/H200")


def check_devices(cfg: RunConfig, visible_gpus: int | None = None) -> None:
    from conveyor.launch import placement
    gpus = visible_gpu_count() if visible_gpus is None else visible_gpus
    _check_field("trainer.device", cfg.trainer.device, gpus)
    _check_field("rollout.device", cfg.rollout.device, gpus)
    if cfg.reward.fn == "rm":
        _check_field("reward.device", cfg.reward.device, gpus)
    if cfg.reward.fn == "judge" and cfg.reward.judge.engine != "remote":
        _check_field("reward.judge.device", cfg.reward.judge.device, gpus)
    _check_fp8(cfg, gpus)
    la = cfg.launch
    if gpus == 0 and not la.in_process and la.placement == "disaggregated" and la.weight_sync == "ipc":
        raise DeviceError("launch.weight_sync=ipc needs GPUs; on CPU use launch.weight_sync=shm or broadcast")
    wants_gpu = cfg.trainer.device != "cpu" and cfg.rollout.device != "cpu"
    try:
        placement.plan(cfg, visible_gpus=gpus if wants_gpu else 0)
    except placement.PlacementError as e:
        raise DeviceError(str(e)) from None
