"""``reward.fn: judge``: the generative judge built from the run's config, checked before the run
starts.

Contract: ``build_judge(cfg, base_path)`` returns a ``reward.judge.JudgeReward`` over a second
rollout engine with frozen weights (``reward.judge.model``, or the policy's base checkpoint). A
judge that cannot work raises ``JudgeSetupError`` (a ``ValueError``), one line naming the field
and the fix, before the run starts.

It knows which config fields make a judge; how the judge scores is ``reward/judge.py``'s.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from conveyor.config import RolloutConfig, RunConfig
from conveyor.reward.judge import JudgeReward

# Architecture names of checkpoints that generate text (a causal LM head).
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


class JudgeSetupError(ValueError):
    """A judge that cannot be built; the message names the field and the fix."""


def build_judge(cfg: RunConfig, base_path: str) -> JudgeReward:
    """Contract: ``build_judge(cfg, base_path)`` returns a ``reward.judge.JudgeReward`` over a second
    rollout engine with frozen weights: ``reward.judge.model`` (a checkpoint directory, a hub id, a
    ``.gguf`` file or ``pkg:<package>`` as for ``model.path``), or when empty ``base_path`` (the
    policy's base checkpoint, so a resumed run judges with the same model), loaded by
    ``rollout.factory.make_engine`` as ``reward.judge.engine`` on ``reward.judge.device``. The
    judge's native engine is built with ``cuda:N`` as the current device (its KV pool and CUDA
    graphs belong to that GPU). The judge scores ``reward.max_batch`` trajectories per call, waits
    at most ``reward.timeout_s`` for its engine, uses ``reward.fallback`` and ``loop.seed``. A
    judge that cannot work raises ``JudgeSetupError`` (a ``ValueError``), one line naming the
    field and the fix: a model directory without ``config.json``, a checkpoint that is not a
    causal language model, a tokenizer that cannot load or has no chat template when
    ``reward.judge.chat_template`` asks for one, a model the engine cannot load,
    ``max_new_tokens`` that leave no room for a prompt, and in pairwise mode a
    ``reward.max_batch`` that is not a multiple of ``rollout.n`` (a group's samples are compared
    within one call).
    """
    jc = cfg.reward.judge
    path = jc.model or base_path
    what = f"reward.judge.model {path!r}" if jc.model else f"the judge (the policy's base checkpoint {path!r})"
    from conveyor.data.gguf import GGUFError, is_gguf_spec, resolve_gguf
    if is_gguf_spec(path):  # a .gguf file or pkg:<package>, converted once as for model.path
        try:
            path = str(resolve_gguf(path))
        except GGUFError as e:
            raise JudgeSetupError(f"reward.judge.model: {e}") from None
    _check_checkpoint(path, what)
    if jc.mode == "pairwise" and cfg.reward.max_batch % cfg.rollout.n:
        raise JudgeSetupError(
            f"reward.judge.mode=pairwise compares a group's samples within one judge call: reward.max_batch "
            f"({cfg.reward.max_batch}) must be a multiple of rollout.n ({cfg.rollout.n})")
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise JudgeSetupError(f"{what}: its tokenizer cannot be loaded ({_first_line(e)})") from None
    if jc.chat_template and not getattr(tokenizer, "chat_template", None):
        raise JudgeSetupError(f"{what}: its tokenizer has no chat template; set reward.judge.chat_template=false "
                              "to send the judge prompt as plain text")
    engine_cfg = RolloutConfig(engine=jc.engine, device=jc.device, dtype=jc.dtype, max_batch=jc.engine_batch,
                               kv_fraction=jc.kv_fraction, prefix_cache="off", remote_url=jc.remote_url,
                               remote_model=jc.remote_model, vllm_kwargs=dict(jc.vllm_kwargs))
    from conveyor.rollout.factory import make_engine
    try:
        with _current_device(jc.device if jc.engine == "native" else "auto"):
            engine = make_engine(engine_cfg, path, tokenizer)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise JudgeSetupError(f"{what} cannot be loaded by the {jc.engine} engine on {jc.device}: "
                              f"{_first_line(e)}") from None
    try:
        return JudgeReward(engine, tokenizer, jc, max_batch=cfg.reward.max_batch, fallback_value=cfg.reward.fallback,
                           seed=cfg.loop.seed, wait_s=cfg.reward.timeout_s)
    except ValueError as e:
        engine.close()
        raise JudgeSetupError(str(e)) from None


def _check_checkpoint(path: str, what: str) -> None:
    p = Path(path).expanduser()
    looks_local = path.startswith((".", "/", "~")) or p.exists() or path.count("/") != 1
    if not looks_local:
        return  # a hub id: the tokenizer and engine loads say whether it exists
    if not (p / "config.json").is_file():
        raise JudgeSetupError(f"{what} is not a Hugging Face checkpoint directory (no config.json); give a "
                              "directory written by save_pretrained or a hub id like org/name")
    try:
        archs = json.loads((p / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        raise JudgeSetupError(f"{what}: its config.json cannot be read ({_first_line(e)})") from None
    if archs and not any(a.endswith(_GENERATIVE) for a in archs):
        raise JudgeSetupError(f"{what} is a {', '.join(archs)} model, not a causal language model that writes "
                              "text; give a generative checkpoint (e.g. an instruct model)")


def _current_device(device: str) -> contextlib.AbstractContextManager:
    """``cuda:N`` as the current CUDA device while the engine is built: its KV pool is sized from
    that GPU's free memory and its CUDA graphs are captured on that GPU's streams."""
    if not device.startswith("cuda:"):
        return contextlib.nullcontext()
    import torch
    return torch.cuda.device(torch.device(device))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
