"""What a device computes natively: the ``native`` dtype of ``rollout.dtype`` and ``trainer.param_dtype``.

``native_bf16(device)`` says whether ``device`` does bfloat16 arithmetic in hardware, with the
reason in words: a CUDA device that supports it, an x86 CPU with AVX512-BF16 or AMX-BF16, an Arm
CPU with the BF16 extension. Elsewhere a CPU emulates bf16 through float32 and runs it several
times slower than float32 itself, so ``native`` then means float32. The answer for the CPU reads
``/proc/cpuinfo`` (Linux); where that cannot be read the CPU counts as not native.
"""
from __future__ import annotations

import functools

_X86 = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo "flags"
_ARM = ("bf16",)                    # /proc/cpuinfo "Features"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device) -> tuple[bool, str]:
    """(does ``device`` compute bf16 natively, why in a few words); ``device``: "cpu", "cuda", "cuda:1"
    or a ``torch.device``."""
    kind = str(device).split(":")[0]
    if kind == "cuda":
        import torch
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return True, "this GPU computes bf16"
        return False, "this GPU has no bf16 arithmetic"
    if kind != "cpu":
        return False, f"bf16 on {kind} is not known to be native"
    flags = _cpu_flags()
    have = [f for f in (*_X86, *_ARM) if f in flags]
    if have:
        return True, f"this CPU computes bf16 ({', '.join(have)})"
    return False, "this CPU has no bf16 arithmetic (no avx512_bf16, amx_bf16 or bf16 flag)"


def native_dtype(device) -> tuple[str, str]:
    """("bfloat16" or "float32", why): what the ``native`` dtype is on ``device``."""
    ok, why = native_bf16(device)
    return ("bfloat16" if ok else "float32"), why
