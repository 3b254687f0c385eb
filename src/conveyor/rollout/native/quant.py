"""8-bit weights for the fast runner's linear layers: FP8 (e4m3, W8A8) and INT8 (weight-only).

- ``QuantWeight(src, kind)`` holds one linear layer's weight as 8-bit values with one scale per
  output channel; ``requantize()`` refreshes them in place (captured CUDA graphs stay valid) and
  ``qw(x, bias)`` computes ``F.linear(x, src, bias)`` from them.
- ``quantize`` / ``dequantize`` are the per-channel round trip; ``error_bound`` the largest
  error the format allows.
- ``fp8_unsupported_reason``, ``check_shape`` and ``runner_for`` refuse settings this device or
  weight cannot run, with a sentence naming why.

It knows nothing of models, layers or weight names: ``decoder.py`` decides which
weights are quantised.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("none", "fp8", "int8")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
INT8_MAX = 127.0
# Floor of a scale: an all-zero row (or activation) must not divide by zero.
_TINY = 1e-12


def fp8_unsupported_reason(device: torch.device) -> str | None:
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"device {device} has no FP8 matrix multiply"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores (needs 8.9+: Ada, Hopper)"
    return None


def runner_for(quantization: str, runner: str, device: torch.device) -> str:
    """The runner to use: quantized weights need the fast one (``auto`` picks it on any device).

    ``fp8_unsupported_reason(device)`` is None where FP8 GEMMs run (CPU, CUDA compute
    capability >= 8.9), else a sentence naming the card; ``check_shape`` refuses fp8
    for weights whose sizes are not multiples of 16 (``_scaled_mm``'s rule);
    ``runner_for(quantization, runner, device)`` is the engine runner a setting
    needs (``fast``; ``auto`` becomes it) or a ``ValueError`` naming the setting.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"rollout.quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return runner
    if runner == "hf":
        raise ValueError(f"rollout.quantization={quantization} needs the fast runner; set rollout.runner=fast "
                         f"(or auto), or rollout.quantization=none")
    reason = fp8_unsupported_reason(device) if quantization == "fp8" else None
    if reason is not None:
        raise ValueError(f"rollout.quantization=fp8: {reason}; use rollout.quantization=int8 or an H100/H200 "
                         f"(or Ada) GPU")
    return "fast"


def check_shape(shape: torch.Size, kind: str) -> None:
    if kind == "fp8" and any(d % 16 for d in shape):
        raise ValueError(f"rollout.quantization=fp8 needs linear weights whose sizes are multiples of 16, got "
                         f"{tuple(shape)}; use rollout.quantization=int8 for this model")


def quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[N, K]`` -> (8-bit ``[N, K]``, float32 scales ``[N]``) with ``w ~= q * scale[:, None]``.

    ``quantize(w, kind)`` / ``dequantize(q, scale)`` are the per-channel round trip;
    ``error_bound(w, scale, kind)`` is the largest error the format allows per element
    (fp8: half an e4m3 step, 2^-4 of the value for normals, 2^-10 * scale below 2^-6 * scale;
    int8: half a step, scale / 2).
    """
    wf = w.float()
    top = FP8_MAX if kind == "fp8" else INT8_MAX
    scale = (wf.abs().amax(dim=1) / top).clamp_(min=_TINY)
    scaled = wf / scale[:, None]
    if kind == "fp8":
        return scaled.to(FP8), scale
    return scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.reshape(-1, 1).float()


def error_bound(w: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-element bound on ``|w - dequantize(quantize(w))|`` that the format allows (see ``quantize``)."""
    s = scale.reshape(-1, 1).float()
    if kind == "int8":
        return (s / 2).expand_as(w)
    # e4m3: 3 mantissa bits, so a normal value is off by at most half a step, 2^-4 of itself;
    # below the smallest normal (2^-6) the step is the subnormal one, 2^-9 (half: 2^-10).
    return torch.maximum(w.float().abs() * 2.0 ** -4, s * 2.0 ** -10)


def int8_method(q: torch.Tensor, dtype: torch.dtype) -> str:
    """``"int8pack"`` (``torch._weight_int8pack_mm``) where it runs for this weight's device, shape
    and the activation dtype and is the faster form (bf16 / fp16 activations: measured 0.9 ms vs
    2.2 ms for the dequantising GEMM at 8 x 896 x 4864 on a CPU core; in float32 it was 10x
    slower), else ``"dequant"``. Tried once on the weight itself, so a shape the kernel refuses
    falls back here rather than failing inside a decode step."""
    if dtype not in (torch.bfloat16, torch.float16) or q.device.type == "cuda":
        # On a GPU the kernel exists but is a slow path (measured 1.1k tok/s at batch 64 on an
        # H200 for W1's 0.5B shape, against 53k in bf16).
        return "dequant"
    try:
        x = torch.zeros(1, q.shape[1], dtype=dtype, device=q.device)
        torch._weight_int8pack_mm(x, q, torch.ones(q.shape[0], dtype=dtype, device=q.device))
    except (RuntimeError, NotImplementedError, TypeError):
        return "dequant"
    return "int8pack"


class QuantWeight:
    """One linear layer's 8-bit weight that follows ``src``.

    - ``QuantWeight(src, kind)`` holds one linear layer's weight ``src`` ``[N, K]`` (the
      engine-dtype tensor that ``update_weights`` copies into) as 8-bit values ``q``
      ``[N, K]`` with one scale per output channel (row): ``src ~= q * scale`` (float32;
      the activation dtype for ``torch._weight_int8pack_mm``, which takes it so).
      ``requantize()`` recomputes ``q`` and ``scale`` from ``src`` in place, so CUDA
      graphs captured over them stay valid. ``shape`` is ``src``'s.
    - ``qw(x, bias)`` computes ``F.linear(x, src, bias)`` from the 8-bit weights:
      fp8 quantises each row of ``x`` to e4m3 with its own scale (dynamic, per token)
      and multiplies with ``torch._scaled_mm`` (row-wise scales; bf16 output on a GPU,
      cast back to ``x``'s dtype; ``fp8_method``: the same product in float32 where a
      CPU build's ``_scaled_mm`` takes only per-tensor scales); int8 keeps ``x`` as it is and dequantises inside the
      product (``torch._weight_int8pack_mm`` where it runs for this device and dtype,
      else ``(x @ q.T) * scale``, see ``int8_method``).
    """

    def __init__(self, src: torch.Tensor, kind: str):
        if kind not in ("fp8", "int8"):
            raise ValueError(f"rollout.quantization {kind!r} is not one of fp8, int8")
        check_shape(src.shape, kind)
        self.src, self.kind = src, kind
        self.q, scale = quantize(src, kind)
        self.method = fp8_method(self.q) if kind == "fp8" else int8_method(self.q, src.dtype)
        # Shapes the GEMMs take: _scaled_mm's row-wise scale of the weight is [1, N];
        # _weight_int8pack_mm wants [N] in the activation dtype.
        self.scale = scale[None, :].contiguous() if kind == "fp8" else scale.to(
            src.dtype if self.method == "int8pack" else torch.float32)
        # A GPU's row-wise FP8 GEMM writes bf16 only; the CPU's writes any float dtype.
        self.out_dtype = torch.bfloat16 if src.device.type == "cuda" else src.dtype

    @property
    def shape(self) -> torch.Size:
        return self.src.shape

    @torch.no_grad()
    def requantize(self) -> None:
        q, scale = quantize(self.src, self.kind)
        self.q.copy_(q)
        self.scale.copy_(scale.reshape(self.scale.shape))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "fp8":
            y = _fp8_linear(x, self.q, self.scale, self.out_dtype, self.method == "scaled_mm")
        elif self.method == "int8pack":
            y = torch._weight_int8pack_mm(x, self.q, self.scale)
        else:
            y = F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if bias is None else y + bias


def fp8_method(q: torch.Tensor) -> str:
    """``"scaled_mm"`` where ``torch._scaled_mm`` takes row-wise scales on this weight's device
    (CUDA; the CPU from torch 2.13), else ``"emulated"``: the same e4m3 values and scales
    multiplied in float32 (older CPU builds take only per-tensor scales). Tried once."""
    if q.device.type == "cuda":
        return "scaled_mm"
    try:
        x = torch.zeros(1, q.shape[1], device=q.device).to(FP8)
        torch._scaled_mm(x, q.t(), scale_a=torch.ones(1, 1), scale_b=torch.ones(1, q.shape[0]),
                         out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return "emulated"
    return "scaled_mm"


def _fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                native: bool = True) -> torch.Tensor:
    """``x`` ``[..., K]`` quantised per row to e4m3, times ``q.T`` with row-wise scales
    (``native=False``: the e4m3 values multiplied in float32, for a ``_scaled_mm`` without them)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    sx = (x2.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=_TINY)
    xq = (x2 / sx).to(FP8)
    if native:
        y = torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=scale, out_dtype=out_dtype)
    else:
        y = ((xq.float() @ q.float().t()) * sx * scale).to(out_dtype)
    return y.reshape(*lead, q.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a plain weight, the 8-bit GEMM for a ``QuantWeight``."""
    if isinstance(w, QuantWeight):
        return w(x, bias)
    return F.linear(x, w, bias)
