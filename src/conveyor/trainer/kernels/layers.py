"""RMSNorm, the SwiGLU product and the fused MLP / attention forwards, for the trainer on a GPU.

RMSNorm as one Triton kernel each way (one read and one write of each row,
the weight's gradient summed in float32) with the Hugging Face module's
numbers; ``silu(gate) * up`` as one kernel each way, reading the packed
output of one gate/up GEMM in place. A norm whose output feeds one GEMM
writes it in autocast's dtype (the numbers the GEMM's cast would make).

Contract: ``use_fused_layers(model) -> int`` swaps the forward of every
supported norm, SiLU MLP and attention module of ``model`` (by class name;
not a block whose projections are wrapped, as LoRA's are) and returns how
many; ``rms_norm(x, weight, eps, out_dtype=None)`` works on any ``[..., H]``,
``swiglu(gate, up)`` on two equal shapes and ``swiglu(packed)`` on
``[..., 2 w]`` (gate then up in each row).
``TRITON_INTERPRET=1`` runs them on CPU tensors (tests do).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}
MLPS = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"}
ELEMENTS = 2048  # SwiGLU: elements per program
ROWS_PER_PROGRAM = 32  # backward: each program sums the weight gradient of this many rows


@triton.jit
def _forward(x, w, y, rstd_out, eps, H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    v = tl.load(x + row * H + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, 0) / H + eps)
    normed = (v * rstd).to(x.dtype.element_ty).to(tl.float32)
    weight = tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y + row * H + cols, (weight * normed).to(y.dtype.element_ty), mask=inside)
    tl.store(rstd_out + row, rstd)


@triton.jit
def _backward(x, w, dy, rstd_in, dx, dw_part, rows, H: tl.constexpr, BLOCK: tl.constexpr,
              PER: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    weight = tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for k in range(PER):
        row = pid.to(tl.int64) * PER + k
        if row < rows:
            v = tl.load(x + row * H + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(dy + row * H + cols, mask=inside, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_in + row)
            normed = v * rstd
            dw += g * normed.to(x.dtype.element_ty).to(tl.float32)
            dn = g * weight
            out = rstd * (dn - normed * (tl.sum(dn * normed, 0) / H))
            tl.store(dx + row * H + cols, out.to(dx.dtype.element_ty), mask=inside)
    tl.store(dw_part + pid * H + cols, dw, mask=inside)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None):
        shape, h = x.shape, x.shape[-1]
        x2 = x.reshape(-1, h).contiguous()
        rows = x2.shape[0]
        out_dtype = out_dtype or torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty((rows, h), dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(h)
        if rows:
            _forward[(rows,)](x2, weight, y, rstd, float(eps), H=h, BLOCK=block, num_warps=4)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(*shape[:-1], h)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        rows, h = x2.shape
        dy2 = dy.reshape(-1, h).contiguous()
        dx = torch.empty_like(x2)
        programs = max(1, triton.cdiv(rows, ROWS_PER_PROGRAM))
        part = torch.zeros((programs, h), dtype=torch.float32, device=x2.device)
        if rows:
            _backward[(programs,)](x2, weight, dy2, rstd, dx, part, rows, H=h,
                                   BLOCK=triton.next_power_of_2(h), PER=ROWS_PER_PROGRAM, num_warps=4)
        return dx.view(ctx.shape), part.sum(0).to(weight.dtype), None, None


@triton.jit
def _swiglu_forward(gate, up, out, n, width, stride, BLOCK: tl.constexpr):
    # element i of the [rows, width] product; gate and up rows are ``stride`` apart (packed)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    at = (idx // width) * stride + idx % width
    g = tl.load(gate + at, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up + at, mask=inside, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + idx, (act * u).to(out.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_backward(gate, up, grad, d_gate, d_up, n, width, stride, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    at = (idx // width) * stride + idx % width
    g = tl.load(gate + at, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up + at, mask=inside, other=0.0).to(tl.float32)
    d = tl.load(grad + idx, mask=inside, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = (g * sig).to(d_up.dtype.element_ty).to(tl.float32)
    d_act = (d * u).to(d_gate.dtype.element_ty).to(tl.float32)
    tl.store(d_up + at, (d * act).to(d_up.dtype.element_ty), mask=inside)
    tl.store(d_gate + at, (d_act * sig * (1.0 + g * (1.0 - sig))).to(d_gate.dtype.element_ty), mask=inside)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` over separate tensors, or over one ``[..., 2 w]`` tensor holding
    gate then up in each row (``packed``: the output of one GEMM against both weights)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor | None):
        packed = up is None
        if packed:
            gate = gate.contiguous()
            width = gate.shape[-1] // 2
            up_src, stride = gate[..., width:], 2 * width
        else:
            gate, up = gate.contiguous(), up.contiguous()
            width, up_src, stride = gate.shape[-1], up, gate.shape[-1]
        out = torch.empty((*gate.shape[:-1], width), dtype=gate.dtype, device=gate.device)
        n = out.numel()
        if n:
            _swiglu_forward[(triton.cdiv(n, ELEMENTS),)](gate, up_src, out, n, width, stride, BLOCK=ELEMENTS,
                                                         num_warps=4)
        ctx.save_for_backward(gate, up_src)
        ctx.meta = (packed, width, stride)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        packed, width, stride = ctx.meta
        grad = grad.contiguous()
        d_gate = torch.empty_like(gate)
        d_up = d_gate[..., width:] if packed else torch.empty_like(up)
        n = grad.numel()
        if n:
            _swiglu_backward[(triton.cdiv(n, ELEMENTS),)](gate, up, grad, d_gate, d_up, n, width, stride,
                                                          BLOCK=ELEMENTS, num_warps=4)
        return d_gate, None if packed else d_up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Hugging Face's RMSNorm; ``out_dtype`` rounds the output (default: as torch promotes).

    HF's module is eight element-wise ops forward and about as many backward (49 norms per
    forward of a 0.5B model, where at hidden size 896 the traffic and launches cost more than the
    arithmetic). Here the forward reads and writes each row once (plus one float32 ``rstd`` per
    row), the backward reads ``x`` and ``dy`` once and writes ``dx`` once, the weight's gradient
    summed in float32 per program and then across programs. Same numbers: statistics in float32,
    the normalised row rounded to the input dtype before it is scaled
    (``weight * x_hat.to(input_dtype)``), gradients through that rounding as autograd takes them.
    """
    return _RMSNorm.apply(x, weight, eps, out_dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``up`` None, ``gate`` is ``[..., 2 w]`` holding gate then up.

    One kernel each way where torch runs two forward and three backward over the layer's widest
    activations; ``silu(gate)`` is rounded to the input dtype before the product, as torch does.
    The packed form is the output of one GEMM against the gate and up weights stacked, read in
    place.
    """
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"swiglu: a packed gate/up needs an even last dimension, got {tuple(gate.shape)}")
    elif gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    return _SwiGLU.apply(gate, up)


def _norm_forward(module, hidden_states: torch.Tensor) -> torch.Tensor:
    # A norm whose output feeds one GEMM (a fused q/k/v or gate/up projection) writes it in
    # autocast's dtype: the same numbers the GEMM's cast would make, without a float32 copy.
    # Feeding several GEMMs it stays float32: autograd would sum their input gradients in bf16,
    # which learns measurably worse (docs/architecture.md, "Choices measured").
    device = hidden_states.device.type
    low = getattr(module, "feeds_one_gemm", False) and torch.is_autocast_enabled(device)
    return rms_norm(hidden_states, module.weight, module.variance_epsilon,
                    torch.get_autocast_dtype(device) if low else None)


def _mlp_forward(module, x: torch.Tensor) -> torch.Tensor:
    # One GEMM against the gate and up weights stacked (a copy of a few MiB): one cast of x,
    # one launch, and x's gradient summed in float32 inside the GEMM.
    gate, up = module.gate_proj, module.up_proj
    bias = None if gate.bias is None else torch.cat([gate.bias, up.bias])
    return module.down_proj(swiglu(F.linear(x, torch.cat([gate.weight, up.weight]), bias)))


def plain_linears(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """Whether these projections are plain ``nn.Linear``: a wrapped one (a LoRA adapter's layer)
    computes more than its ``weight``, which a fused forward reading the weights would skip."""
    return all(type(getattr(module, n, None)) is torch.nn.Linear for n in names)


def use_fused_layers(model: torch.nn.Module) -> int:
    """Swap in the fused forwards; returns how many modules changed."""
    from conveyor.trainer.kernels.attention import fusable, fused_attention_forward
    count = 0
    for m in model.modules():
        name = type(m).__name__
        if name in NORMS and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_norm_forward, m)
        elif name in MLPS and getattr(getattr(m, "config", None), "hidden_act", None) in ("silu", "swish") \
                and plain_linears(m, ("gate_proj", "up_proj")):
            m.forward = types.MethodType(_mlp_forward, m)
        elif fusable(m):
            m.forward = types.MethodType(fused_attention_forward, m)
        else:
            continue
        count += 1
    for layer in model.modules():  # a decoder layer: each norm feeds only the block after it
        for norm, block in (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")):
            n, b = getattr(layer, norm, None), getattr(layer, block, None)
            if n is not None and b is not None and "forward" in vars(n) and "forward" in vars(b):
                n.feeds_one_gemm = True
    return count
