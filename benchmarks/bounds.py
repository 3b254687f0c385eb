"""Model shapes, device facts and the physical bounds printed beside every measurement.

Contract
- ``SHAPES`` holds the decoder shapes the harnesses build (the Qwen2.5-0.5B
  and 1.5B configurations of BENCHMARKS.md, and a tiny one for CPU smoke
  runs). ``param_count``, ``weight_bytes`` and ``kv_bytes_per_token`` are
  exact for the Qwen2 architecture (q/k/v biases, SwiGLU MLP, RMSNorm,
  optionally tied embeddings).
- ``device_spec(name)`` maps a device name to its memory bandwidth and the
  peak matrix FLOP/s the protocol uses (800 TFLOP/s bf16 for H100 and H200,
  the measured matrix-product rate); unknown devices, CPUs included, get
  ``None`` for both, printed as "n/a".
- ``decode_bound_tokens_per_s`` and ``train_bound_tokens_per_s`` are the
  formulas of BENCHMARKS.md section "Physical bounds".
- ``describe_machine()`` returns the device name (``torch.cuda.get_device_name()``
  when CUDA is usable in this process, else the CPU model from
  /proc/cpuinfo) and the library versions; ``device_name_no_cuda_init()``
  gives the name without creating a CUDA context (for the parent process,
  which must leave the GPU to its children).

It does not measure anything and does not know which system is being run.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    max_positions: int
    arch: str = "qwen2"  # qwen2: q/k/v biases; llama: none

    def as_dict(self) -> dict:
        return asdict(self)


SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 64, 4864, 151_936, True, 32_768),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 128, 8960, 151_936, True, 32_768),
    # SmolLM2-135M-Instruct's shape (the real model of the CPU recipes), random init on a GPU.
    "smollm2-135m": Shape(576, 30, 9, 3, 64, 1536, 49_152, True, 8_192, "llama"),
    # CPU smoke shape: same architecture, small enough that a W1 step takes seconds.
    "tiny": Shape(128, 2, 4, 2, 32, 384, 4096, False, 2048),
}

# Bandwidth in bytes/s (vendor numbers); peak in FLOP/s (the protocol's measured bf16 rate).
# Longer keys first: "H100 NVL" and "H100 PCIe" must win over plain "H100".
_DEVICES: tuple[tuple[str, float, float | None], ...] = (
    ("H200", 4.8e12, 800e12),
    ("H100 NVL", 3.9e12, 800e12),
    ("H100 PCIe", 2.0e12, 800e12),
    ("H100", 3.35e12, 800e12),
    ("A100-SXM4-80GB", 2.039e12, None),
    ("A100 80GB PCIe", 1.935e12, None),
    ("A100", 1.555e12, None),
)


def param_count(s: Shape) -> int:
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2  # q, o, k, v
    if s.arch == "qwen2":
        attn += s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim                        # q/k/v biases
    layer = attn + 3 * s.hidden * s.ffn + 2 * s.hidden                                     # MLP, 2 norms
    embed = s.vocab * s.hidden * (1 if s.tied else 2)
    return s.layers * layer + embed + s.hidden                                             # final norm


def weight_bytes(s: Shape, bytes_per_param: int = 2) -> int:
    return param_count(s) * bytes_per_param


def kv_bytes_per_token(s: Shape, bytes_per_value: int = 2) -> int:
    return 2 * s.layers * s.kv_heads * s.head_dim * bytes_per_value


def device_spec(name: str) -> dict:
    for key, bandwidth, peak in _DEVICES:
        if key.lower() in name.lower():
            return {"bandwidth_bytes_per_s": bandwidth, "peak_flops": peak}
    return {"bandwidth_bytes_per_s": None, "peak_flops": None}


def decode_bound_tokens_per_s(s: Shape, batch: int, context: float, bandwidth: float | None,
                              bytes_per_param: int = 2) -> float | None:
    """tokens/s <= B / ((weight bytes + B x L x KV bytes per token) / bandwidth)."""
    if not bandwidth:
        return None
    step_s = (weight_bytes(s, bytes_per_param) + batch * context * kv_bytes_per_token(s, bytes_per_param)) / bandwidth
    return batch / step_s


def train_bound_tokens_per_s(s: Shape, peak_flops: float | None, recompute: bool = False) -> float | None:
    """tokens/s <= peak / (6N), or 8N when the trainer recomputes logprobs in an extra forward."""
    if not peak_flops:
        return None
    return peak_flops / ((8 if recompute else 6) * param_count(s))


def bounds(s: Shape, device: str, batch: int, context: float, bytes_per_param: int = 2,
           recompute: bool = False) -> dict:
    """Everything the tables print beside a measurement, for one model on one device."""
    spec = device_spec(device)
    return {
        "params": param_count(s), "weight_bytes": weight_bytes(s, bytes_per_param),
        "kv_bytes_per_token": kv_bytes_per_token(s, bytes_per_param),
        **spec, "decode_batch": batch, "decode_context": context,
        "decode_bound_tokens_per_s": decode_bound_tokens_per_s(s, batch, context, spec["bandwidth_bytes_per_s"],
                                                               bytes_per_param),
        "train_bound_tokens_per_s": train_bound_tokens_per_s(s, spec["peak_flops"], recompute),
        "flops_per_token_factor": 8 if recompute else 6,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores visible)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores visible)"


def device_name_no_cuda_init() -> str:
    # nvidia-smi answers without creating a CUDA context in this process.
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
            if out:
                return out[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return cpu_name()


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "trl", "conveyor", "accelerate", "datasets"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    out["conveyor_git"] = _git_rev()
    try:
        import conveyor
        out["conveyor_path"] = str(Path(conveyor.__file__).resolve().parent)
    except ImportError:
        out["conveyor_path"] = None
    return out


def _git_rev() -> str | None:
    # The commit of the conveyor that is imported (an editable install's checkout), not of this file.
    try:
        import conveyor
        root = Path(conveyor.__file__).resolve().parent
    except ImportError:
        return None
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{rev}{'-dirty' if dirty else ''}" if rev else None


def describe_machine() -> dict:
    """Device name and versions as seen from this process (call it where the work runs)."""
    import torch
    if torch.cuda.is_available():
        device, kind = torch.cuda.get_device_name(), "cuda"
    else:
        device, kind = cpu_name(), "cpu"
    return {"device": device, "device_kind": kind, "versions": versions(), "torch_threads": torch.get_num_threads()}
