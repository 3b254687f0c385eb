"""make_engine picks the engine by rollout.engine and names what is missing."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from conveyor.config import RolloutConfig
from conveyor.data.tiny import build_tiny
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.factory import make_engine
from conveyor.rollout.native.engine import NativeEngine


def test_native_by_default(tmp_path):
    path = str(build_tiny(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                          intermediate_size=64))
    engine = make_engine(RolloutConfig(device="cpu"), path)
    assert isinstance(engine, NativeEngine)
    out = engine.generate([[1, 5]], SamplingParams(temperature=0, n=2, max_new_tokens=3))
    assert len(out[0]) == 2 and out[0][0].token_ids == out[0][1].token_ids


def test_unknown_engine_and_missing_url_are_named():
    with pytest.raises(ValueError, match="rollout.engine 'tgi' is not one of native, vllm, remote"):
        make_engine(SimpleNamespace(engine="tgi"), "unused")
    with pytest.raises(ValueError, match="needs rollout.remote_url"):
        make_engine(SimpleNamespace(engine="remote", remote_url=None), None)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_without_vllm_names_the_install():
    from conveyor.rollout.vllm import VLLMNotInstalledError
    with pytest.raises(VLLMNotInstalledError, match="pip install"):
        make_engine(SimpleNamespace(engine="vllm", dtype="auto"), "unused")
