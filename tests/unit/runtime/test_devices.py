"""The ``native`` dtype: bf16 where the device computes it in hardware, float32 elsewhere."""
import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.rollout.native.engine import NativeEngine, resolve_dtype
from conveyor.runtime import devices
from conveyor.trainer.precision import compute_dtype

FLAGS = {
    "x86 with AMX": "fpu sse2 avx2 avx512f amx_bf16 amx_tile",
    "x86 with AVX512-BF16": "fpu sse2 avx2 avx512f avx512_bf16",
    "arm with BF16": "fp asimd sve bf16 i8mm",
    "x86 with AVX2 only": "fpu sse2 avx2 fma",
    "x86 with AVX-512 but no bf16": "fpu avx2 avx512f avx512bw avx512_vnni",
}


@pytest.fixture
def cpu(monkeypatch):
    def set_flags(line: str) -> None:
        monkeypatch.setattr(devices, "_cpu_flags", lambda: frozenset(line.split()))
    return set_flags


@pytest.mark.parametrize("kind", list(FLAGS))
def test_native_is_bf16_exactly_where_the_cpu_computes_it(cpu, kind):
    cpu(FLAGS[kind])
    native = "only" not in kind and "no bf16" not in kind
    ok, why = devices.native_bf16("cpu")
    assert ok is native and why
    assert devices.native_dtype(torch.device("cpu"))[0] == ("bfloat16" if native else "float32")
    want = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("native", "cpu") is want
    assert compute_dtype(TrainerConfig(param_dtype="native"), torch.device("cpu")) is want
    # auto keeps its meaning whatever the CPU: the checkpoint's dtype for engines, float32 for the trainer
    assert resolve_dtype("auto", "cpu") is None
    assert compute_dtype(TrainerConfig(param_dtype="auto"), torch.device("cpu")) is torch.float32


def test_cpuinfo_of_this_machine_is_read():
    devices._cpu_flags.cache_clear()
    with open("/proc/cpuinfo") as f:
        has_flags = any(line.split(":")[0].strip() in ("flags", "Features") for line in f)
    assert bool(devices._cpu_flags()) == has_flags


def test_an_engine_says_what_native_chose(cpu):
    from transformers import LlamaConfig, LlamaForCausalLM
    cpu(FLAGS["x86 with AVX2 only"])
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    engine = NativeEngine(model, device="cpu", dtype="native", runner="hf")
    assert engine.model.dtype is torch.float32
    assert "rollout.dtype=native: float32 (this CPU has no bf16 arithmetic" in engine.label
    cpu(FLAGS["x86 with AMX"])
    engine = NativeEngine(model, device="cpu", dtype="native", runner="hf")
    assert engine.model.dtype is torch.bfloat16 and "native: bfloat16 (this CPU computes bf16 (amx_bf16))" in engine.label
