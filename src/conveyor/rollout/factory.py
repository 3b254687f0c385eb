"""Engine selection: one function from the rollout config to a RolloutEngine.

- ``make_engine(cfg_rollout, model_path, tokenizer)``: ``native``, ``vllm`` or ``remote``; an
  unknown engine name raises ``ValueError`` naming the choices.
- ``prepare_engine(cfg_rollout, model_path)`` imports what ``make_engine`` will and builds
  nothing on a device: what a standby engine process does ahead of need.

It does not know how engines generate or load weights, and imports each engine
(and vLLM) only when that engine is chosen.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config import RolloutConfig
    from conveyor.rollout.api import RolloutEngine

ENGINES = ("native", "vllm", "remote")


def make_engine(cfg_rollout: "RolloutConfig", model_path: str, tokenizer: Any = None) -> "RolloutEngine":
    """The engine named by ``cfg_rollout.engine``, built for ``model_path`` and ``tokenizer``.

    Contract: ``make_engine(cfg_rollout, model_path, tokenizer)`` returns
    - ``"native"``: ``NativeEngine`` loaded from ``model_path`` (device, dtype, max_batch);
    - ``"vllm"``: ``VLLMEngine`` on ``model_path`` in this process (``vllm_kwargs``,
      ``vllm_weight_sync`` when the config has those fields);
    - ``"remote"``: ``RemoteEngine`` for the server at ``remote_url`` (``remote_model``,
      ``remote_weight_sync``, ``remote_timeout_s``); ``model_path`` is only used for
      EOS ids and the config files that SGLang's disk reload needs.
    The optional config fields are read with ``getattr`` so this module works with a
    ``RolloutConfig`` that does not define them yet (they then take their defaults).
    An unknown engine name raises ``ValueError`` naming the choices.
    """
    name = cfg_rollout.engine
    if name == "native":
        from conveyor.rollout.native.engine import NativeEngine
        return NativeEngine.from_pretrained(model_path, device=cfg_rollout.device, dtype=cfg_rollout.dtype,
                                            max_batch=cfg_rollout.max_batch, tokenizer=tokenizer,
                                            runner=cfg_rollout.runner, kv_fraction=cfg_rollout.kv_fraction,
                                            kv_blocks=cfg_rollout.kv_blocks, block_size=cfg_rollout.block_size,
                                            cuda_graphs=cfg_rollout.cuda_graphs,
                                            prefix_cache=cfg_rollout.prefix_cache,
                                            quantization=getattr(cfg_rollout, "quantization", "none"),
                                            record_experts=getattr(cfg_rollout, "record_experts", False))
    if name == "vllm":
        from conveyor.rollout.vllm import VLLMEngine
        return VLLMEngine.from_config(cfg_rollout, model_path, tokenizer)
    if name == "remote":
        from conveyor.rollout.remote import RemoteEngine
        return RemoteEngine.from_config(cfg_rollout, model_path, tokenizer)
    raise ValueError(f"rollout.engine {name!r} is not one of {', '.join(ENGINES)}")


def prepare_engine(cfg_rollout: "RolloutConfig", model_path: str) -> None:
    """Import what ``make_engine(cfg_rollout, model_path)`` needs, allocating nothing on a device.

    ``prepare_engine(cfg_rollout, model_path)`` imports what ``make_engine`` will
    (the engine's module; for the native engine the model's classes, resolved by
    an empty model on the ``meta`` device, and its tokenizer) and builds nothing
    on a device: what a standby engine process does ahead of need.
    """
    name = cfg_rollout.engine
    if name == "native":
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        import conveyor.rollout.native.engine  # noqa: F401 - imported for the build to come
        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):  # the model's modules are imported; no weights are made
            AutoModelForCausalLM.from_config(config)
        AutoTokenizer.from_pretrained(model_path)
    elif name == "vllm":
        import conveyor.rollout.vllm  # noqa: F401
    elif name == "remote":
        import conveyor.rollout.remote  # noqa: F401
    else:
        raise ValueError(f"rollout.engine {name!r} is not one of {', '.join(ENGINES)}")
