"""rollout/native: the built-in engine (scheduler, paged fast runner or HF runner, float32 sampler)."""
from conveyor.rollout.native.engine import NativeEngine

__all__ = ["NativeEngine"]
