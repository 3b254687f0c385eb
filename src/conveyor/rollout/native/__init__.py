"""rollout/native: the built-in engine (request-level scheduler, HF model runner, float32 sampler)."""
from conveyor.rollout.native.engine import NativeEngine

__all__ = ["NativeEngine"]
