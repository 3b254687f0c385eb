"""Typed run configuration: one pydantic model per role, composed into RunConfig.

Contract: ``load_config(path, overrides)`` reads a YAML or TOML recipe (or
nothing: the built-in default), applies dotted ``key=value`` overrides, and
validates everything at load time. Unknown keys and wrong types raise
``ConfigError`` whose message names the dotted field and what was expected.
This module imports no torch, so the CLI can validate a recipe instantly.
It does not know how a field is used; each role reads its own section.
"""
from __future__ import annotations

import difflib
import json
import textwrap
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from conveyor import staleness


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message is one line per problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Section):
    """The locally built Llama-architecture model used when ``model.path`` is empty."""
    hidden_size: int = Field(128, gt=0, description="width of the tiny model")
    num_layers: int = Field(4, gt=0, description="decoder layers")
    num_heads: int = Field(4, gt=0, description="attention heads")
    num_kv_heads: int = Field(2, gt=0, description="key/value heads (grouped-query attention)")
    intermediate_size: int = Field(384, gt=0, description="MLP width")
    max_position_embeddings: int = Field(256, gt=0, description="context length in tokens (prompt + completion)")


class ModelConfig(_Section):
    path: str | None = Field(None, description="HF checkpoint directory or hub id; empty builds the tiny model")
    tiny: TinyModelConfig = Field(TinyModelConfig(),
        description="shape of the tiny model built when model.path is empty")
    trust_remote_code: bool = Field(False, description="allow a hub model's own Python code")


class DataConfig(_Section):
    source: str = Field("synthetic:addition", description=(
        "synthetic:<name> | jsonl | parquet | hf | gsm8k (jsonl or hf in GSM8K format)"))
    path: str | None = Field(None, description="file path (jsonl/parquet) or HF dataset name (hf)")
    split: str = Field("train", description="training split (hf sources)")
    eval_path: str | None = Field(None,
        description="held-out file or dataset; default: eval_size rows held out of data.path")
    eval_split: str | None = Field(None, description="held-out split (hf sources)")
    prompt_field: str = Field("prompt", description="row field holding the prompt")
    answer_field: str = Field("answer", description="row field holding the reference answer (task.answer)")
    chat_template: bool = Field(False, description="render prompts through the tokenizer's chat template")
    system_prompt: str | None = Field(None, description="system message (needs chat_template=true)")
    prompt_template: str = Field("{prompt}", description="format string applied to the prompt field")
    skip_invalid: bool = Field(False, description="skip rows without a prompt instead of stopping")
    eval_size: int = Field(256, ge=0, description="held-out tasks (synthetic tasks, or rows held out of data.path)")
    seed: int = Field(0, description="seed of the synthetic tasks and of the held-out split")
    options: dict[str, Any] = Field(default_factory=dict, description="task-specific options (e.g. digits)")


class RolloutConfig(_Section):
    engine: Literal["native", "vllm", "remote"] = Field("native", description=(
        "native: the built-in engine; vllm: vLLM in the engine's process; remote: an OpenAI-compatible server"))
    n: int = Field(8, ge=1, description="samples per task (group size)")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of rollouts (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 disables")
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    max_new_tokens: int = Field(16, ge=1, description="most tokens per completion")
    stop: list[str] = Field(default_factory=list, description="stop strings (the EOS token always stops)")
    max_batch: int = Field(512, ge=1, description="sequences decoded together")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (in-process engine)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "engine weights; auto keeps the checkpoint's dtype (the trainer always keeps fp32 master weights)"))
    eos_bias: float = Field(0.0, description="added to the EOS logit (benchmark length shaping)")
    runner: Literal["auto", "fast", "hf"] = Field("auto", description=(
        "native engine: fast = own forward, paged KV cache, CUDA graphs (Llama/Qwen2/Qwen3); hf = the "
        "Hugging Face forward (any model); auto = fast on a GPU for supported models, else hf"))
    kv_fraction: float = Field(0.4, gt=0, le=0.95, description="fast runner: share of free GPU memory for the KV pool")
    kv_blocks: int | None = Field(None, ge=1, description="fast runner: KV pool size in blocks (overrides kv_fraction)")
    block_size: int = Field(16, ge=1, description="fast runner: tokens per KV block")
    cuda_graphs: bool = Field(True, description="fast runner: capture decode steps in CUDA graphs")
    prefix_cache: Literal["auto", "off", "version", "stale"] = Field("auto", description=(
        "fast runner: keep ended sequences' KV blocks for requests that start with the same tokens (a "
        "multi-turn episode's next turn). version: only KV of the weights being served; stale: also across "
        "weight swaps, as partial rollouts keep a running generation's KV; auto: stale with env.name, partial "
        "rollouts and max_staleness > 0, version with env.name otherwise, else off"))
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "extra vllm.LLM arguments (gpu_memory_utilization, tensor_parallel_size, enable_sleep_mode, ...)"))
    vllm_weight_sync: Literal["reload", "nccl", "ipc"] = Field("reload", description=(
        "reload: safetensors in /dev/shm + reload_weights; nccl: trainer on its own GPU; ipc: same GPU"))
    remote_url: str | None = Field(None, description="http://host:port of an OpenAI-compatible server")
    remote_model: str | None = Field(None, description="served model name; default: the server's first model")
    remote_weight_sync: Literal["vllm_reload", "vllm_nccl", "sglang_disk", "none"] = Field("none",
        description="how a remote server receives new weights; none = never")
    remote_timeout_s: float = Field(600.0, gt=0, description="deadline of one HTTP request")

    @model_validator(mode="after")
    def _remote_needs_url(self) -> "RolloutConfig":
        if self.engine == "remote" and not self.remote_url:
            raise ValueError("rollout.engine=remote needs rollout.remote_url=http://host:port")
        return self


class JudgeConfig(_Section):
    """The generative judge of reward.fn=judge: a frozen model that reads each completion and writes a
    critique ending in a score (docs/rewards.md, "Generative judges")."""
    model: str | None = Field(None, description=(
        "the judge: a Hugging Face checkpoint directory or hub id (its tokenizer too); empty: the policy's "
        "base checkpoint (model.path, or the tiny model built for the run), frozen"))
    engine: Literal["native", "vllm", "remote"] = Field("native", description=(
        "native: the built-in engine; vllm: vLLM in this process; remote: an OpenAI-compatible server at "
        "reward.judge.remote_url (judge.model then names the tokenizer)"))
    device: str = Field("auto", description=(
        "where the judge's engine runs: auto | cpu | cuda | cuda:N (a GPU of its own, e.g. cuda:1)"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "the judge's weights; auto keeps the checkpoint's dtype"))
    engine_batch: int = Field(256, ge=1, description="sequences the judge's engine decodes together")
    kv_fraction: float = Field(0.2, gt=0, le=0.95, description=(
        "native engine on a GPU: share of free GPU memory for the judge's KV pool (the judge starts before "
        "the policy's engines, which take their share of what is left)"))
    remote_url: str | None = Field(None, description="engine=remote: http://host:port of the judge's server")
    remote_model: str | None = Field(None, description="engine=remote: served model name; default: the first")
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict, description="engine=vllm: extra vllm.LLM arguments")
    mode: Literal["pointwise", "pairwise"] = Field("pointwise", description=(
        "pointwise: each completion scored alone; pairwise: each compared with the other samples of its "
        "group in the same judge call, both orders, its reward the mean win probability (a lone sample: "
        "against the task's reference answer); a group of n costs n(n-1) judge prompts instead of n"))
    template: str | None = Field(None, description=(
        "the judge's prompt: pointwise fields {prompt} {completion} {answer}, pairwise {prompt} {answer} "
        "{completion_a} {completion_b}; empty: the built-in template of the mode (a critique, then a last "
        "line 'Score: N', N from 0 to 10)"))
    chat_template: bool = Field(True, description=(
        "send the prompt as a user message through the judge tokenizer's chat template"))
    samples: int = Field(1, ge=1, description="judgements per prompt, aggregated (test-time scaling)")
    aggregate: Literal["mean", "vote"] = Field("mean", description=(
        "how samples combine: mean of their scores, or vote: the majority score (pairwise: the majority "
        "winner; a tie counts half)"))
    max_new_tokens: int = Field(128, ge=1, description="most tokens of one judgement")
    temperature: float = Field(0.7, ge=0.0, description="judge sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="judge nucleus sampling; 1 disables")
    score_pattern: str = Field(r"Score:\s*(-?\d+(?:\.\d+)?)", description=(
        "regular expression; the first group of its LAST match in a judgement is the score"))
    score_min: float = Field(0.0, description="lowest score of the declared range (maps to reward 0)")
    score_max: float = Field(10.0, description="highest score of the declared range (maps to reward 1)")
    fallback: Literal["value", "hash"] = Field("value", description=(
        "reward of a completion none of whose judgements parse (no score, or one outside the range): value = "
        "reward.fallback; hash = a pseudo-random number in [0, 1) from its text and loop.seed; counted either way"))

    @model_validator(mode="after")
    def _usable(self) -> "JudgeConfig":
        import re

        from conveyor.reward.judge_text import DEFAULT_TEMPLATES, pattern_problem, template_problem
        problem = template_problem(self.template or DEFAULT_TEMPLATES[self.mode], self.mode)
        if problem:
            raise ValueError(f"reward.judge.template {problem}")
        problem = pattern_problem(self.score_pattern)
        if problem:
            raise ValueError(f"reward.judge.score_pattern {problem}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"reward.judge.device={self.device!r}: give auto, cpu, cuda or cuda:N")
        if not self.score_min < self.score_max:
            raise ValueError(f"reward.judge.score_min ({self.score_min}) must be below score_max ({self.score_max})")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"reward.judge.samples={self.samples} at temperature 0 are one judgement repeated; "
                             "set reward.judge.temperature > 0 or samples=1")
        if self.engine == "remote" and not self.remote_url:
            raise ValueError("reward.judge.engine=remote needs reward.judge.remote_url=http://host:port")
        return self


class RewardComponentConfig(_Section):
    """One component of a composite reward (reward.components; docs/rewards.md, "Composing rewards")."""
    fn: str = Field(description="builtin name (math, exact, format) or dotted path module:fn of this component")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of this component")
    weight: float = Field(1.0, description="the total reward adds weight * this component's value")
    gate: float | None = Field(None, description=(
        "the value this component must reach (>=); below it, the components after it are not run and the "
        "total is what the components so far gave (format before correctness); null = no gate"))
    name: str | None = Field(None, description=(
        "its key in reward_info and metrics (reward_<name>); default: the last part of fn"))


class RewardConfig(_Section):
    fn: str = Field("auto", description=(
        "builtin name (math, exact, format, code, task), rm (the reward model at reward.model), judge (the "
        "generative judge of reward.judge), a dotted path module:fn, or http://host:port of a reward served by "
        "`conveyor serve-reward` (reward.kwargs then configure the client: timeout_s, retries, ...)"))
    kwargs: dict[str, Any] = Field(default_factory=dict,
        description="keyword arguments passed to the reward function")
    timeout_s: float = Field(5.0, gt=0, description=(
        "deadline of one reward call; for a batched reward (reward model, judge) of one call on a whole batch"))
    fallback: float = Field(0.0, description="reward used when the verifier raises or times out")
    workers: int = Field(2, ge=1, description="reward calls run in parallel")
    executor: Literal["thread", "process"] = Field("thread", description=(
        "what runs reward calls: thread = worker threads of the controller (a call past timeout_s is "
        "abandoned, its thread runs on); process = worker processes, each loading the reward itself (calls "
        "run in parallel without the GIL, a call past timeout_s is killed with its process, a crashed worker "
        "is replaced); per-trajectory rewards, and reward models (reward.fn=rm: each worker loads its own copy "
        "on reward.device and scores whole batches)"))
    max_restarts: int = Field(16, ge=0, description=(
        "executor=process: worker deaths in a row (no call answered in between) survived by starting a "
        "replacement; one more stops the run naming the reward. Timeouts do not count"))
    components: list[RewardComponentConfig] = Field(default_factory=list, description=(
        "several rewards as one: [{fn, kwargs, weight, gate, name}, ...] run in order, total = sum of weight * "
        "value, each value logged as reward_<name>; replaces reward.fn (leave it auto)"))
    batch_wait_ms: float = Field(20.0, ge=0, description=(
        "batched rewards: how long the oldest waiting trajectory waits for a batch to fill before a call "
        "scores fewer than max_batch (while every worker is busy, batches fill by themselves)"))
    max_batch: int = Field(32, ge=1, description="batched rewards (reward.fn=rm, judge): most trajectories per call")
    model: str | None = Field(None, description=(
        "reward.fn=rm: the reward model, a Hugging Face sequence-classification checkpoint with one output "
        "(num_labels 1), such as `conveyor train-rm` writes"))
    device: str = Field("auto", description=(
        "reward.fn=rm: where the reward model runs: trainer (on the device of trainer rank 0, its memory "
        "shared with the trainer and, colocated, the engine), cpu, cuda or cuda:N; auto = trainer"))
    normalize: Literal["none", "sigmoid", "standard"] = Field("none", description=(
        "reward.fn=rm: none = the model's score as is; sigmoid = in (0, 1); standard = (score - mean) / std "
        "with the mean and std train-rm measured on its held-out completions"))
    judge: JudgeConfig = Field(JudgeConfig(), description="reward.fn=judge: the generative judge")

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        import re
        if not re.fullmatch(r"auto|trainer|cpu|cuda(:\d+)?", v):
            raise ValueError(f"reward.device={v!r}: give auto, trainer, cpu, cuda or cuda:N")
        return v

    @model_validator(mode="after")
    def _judge_needs_fn(self) -> "RewardConfig":
        if self.fn != "judge" and self.judge != JudgeConfig():
            raise ValueError(f"reward.judge is set but reward.fn={self.fn}; set reward.fn=judge to use the judge")
        return self

    @model_validator(mode="after")
    def _rm_needs_model(self) -> "RewardConfig":
        if self.fn == "rm" and not self.model:
            raise ValueError("reward.fn=rm needs reward.model=PATH (a checkpoint written by conveyor train-rm "
                             "or another sequence-classification model with one output)")
        return self

    @model_validator(mode="after")
    def _executor_and_components(self) -> "RewardConfig":
        if self.executor == "process" and (self.fn == "judge" or self.fn.startswith(("http://", "https://"))):
            held = "an inference engine" if self.fn == "judge" else "a connection to its server"
            raise ValueError(f"reward.executor=process: reward.fn={self.fn} scores with {held} that the controller "
                             "holds and a worker process cannot rebuild from the config; use reward.executor=thread")
        if not self.components:
            return self
        if self.fn != "auto" or self.kwargs:
            raise ValueError(f"reward.components replaces reward.fn and reward.kwargs (set: fn={self.fn!r}, "
                             f"kwargs={self.kwargs}); leave reward.fn auto and give each component its own kwargs")
        from conveyor.reward.compose import check_parts, parts_of
        try:
            check_parts(parts_of(self.components))
        except ValueError as e:
            raise ValueError(f"reward.components: {e}") from None
        return self


class TrainerConfig(_Section):
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N (single-device trainer)")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate of RL")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up steps")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant",
        description="learning rate after warm-up")
    total_steps: int | None = Field(None, description="for decaying schedules; defaults to loop.steps")
    max_grad_norm: float | None = Field(1.0, description="None disables clipping")
    micro_batch_tokens: int = Field(8192, ge=1, description="token budget of one micro-batch (padded)")
    pad_multiple: int = Field(1, ge=1, description=(
        "pad each micro-batch's length up to a multiple of this, so that steps repeat a few shapes "
        "(per-shape attention plans and allocator blocks are then reused); 1 = pad to the longest only"))
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward (less memory, slower)")
    async_checkpoint: bool = Field(True, description=(
        "single-device trainer: a checkpoint's files are written by a thread from host copies while training "
        "goes on (costs host memory of the weights and optimizer state for the write); sharded checkpoints "
        "are written in the step"))
    attention_mask: bool = Field(False, description=(
        "pass the padding mask to the model. Micro-batches are right-padded, so causal attention alone "
        "already keeps every real token off the padding, and without a mask attention runs its fused "
        "causal (flash) kernel; set true only for a model whose attention is not causal"))
    logprob_chunk_rows: int | None = Field(1024, ge=1, description=(
        "positions per chunk of the logprob head (no float32 copy of the vocabulary logits); "
        "null = the plain autograd form"))
    compile: bool = Field(False, description=(
        "experimental: torch.compile each decoder layer and the logprob head, fusing the small memory-bound "
        "ops of norms, rotary and activations; the first steps pay for compilation (minutes on a GPU)"))
    autocast_bf16: bool = Field(True, description="bf16 autocast on GPU (ignored on CPU)")
    param_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "dtype of the linear layers' weights that forward and backward run on (single-device trainer); "
        "the optimizer keeps float32 master weights either way. auto: bfloat16 on a GPU with autocast_bf16 "
        "(bf16 copies of the linear weights under autocast, gradients summed in float32; embeddings, norms "
        "and biases stay float32: autocast's numbers without its per-op weight casts), float32 on CPU (exact)"))
    kernels: bool = Field(True, description=(
        "on a GPU with Triton, our fused kernels for the logprob head (one read of the logits per pass) "
        "and for RMSNorm, the SwiGLU product and the rotary embedding, with one GEMM for q/k/v and one for "
        "gate/up (Llama/Qwen2/Mistral); false = plain torch ops"))
    fsdp_reshard: Literal["micro-batch", "step"] = Field("micro-batch", description=(
        "several trainer ranks (FSDP2): when a decoder layer's gathered weights are freed. micro-batch: "
        "after its forward and again after its backward (least memory; gathered twice per micro-batch); "
        "step: kept from the step's first forward to its last backward, so each layer is gathered once "
        "per optimizer step (every rank then holds the whole model in the gather dtype during the step)"))
    reference: bool = Field(False, description="keep a frozen reference model (needed for a KL term)")
    critic: bool = Field(False, description="train a value head (needed for GAE / PPO with a critic)")
    critic_lr: float = Field(1e-5, gt=0, description="learning rate of the value head")
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per pass")
    profile_steps: list[int] = Field(default_factory=list, description=(
        "train() calls (0-based loop steps) to record with torch.profiler: a trace for chrome://tracing or "
        "Perfetto and a table of the top operators, per rank, in profile_dir"))
    profile_dir: str | None = Field(None, description="where profile_steps write; default <run dir>/profile")

    @field_validator("profile_steps")
    @classmethod
    def _steps_not_negative(cls, v: list[int]) -> list[int]:
        if any(s < 0 for s in v):
            raise ValueError(f"steps are 0-based loop steps, got {v}; list steps >= 0")
        return v


class AlgoConfig(_Section):
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce++", "gae"] = Field("grpo",
        description="advantage estimator")
    loss: Literal["auto", "ppo", "gspo", "decoupled_ppo"] = Field("auto", description=(
        "auto: decoupled_ppo when loop.max_staleness > 0 (the ratio against the policy being trained, "
        "stale behaviour weights truncated at is_cap), else ppo"))
    clip_low: float | None = Field(None, ge=0, description="default 0.2 (ppo) or 3e-4 (gspo)")
    clip_high: float | None = Field(None, ge=0, description="default 0.2 (ppo) or 4e-4 (gspo); > clip_low = clip-higher")
    dual_clip: float | None = Field(None, description="dual-clip constant c > 1, None disables")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"] = Field("token-mean", description=(
        "how token losses become one number: mean over all tokens, or per sequence then over sequences"))
    kl_coef: float = Field(0.0, ge=0,
        description="weight of the KL penalty to the reference model (needs trainer.reference)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (k3: unbiased, non-negative)")
    kl_in_reward: bool = Field(False, description="subtract the KL from the reward instead of adding it to the loss")
    entropy_coef: float = Field(0.0, description="entropy bonus weight")
    importance_sampling: Literal["none", "truncated", "masked"] = Field("none",
        description="correct engine/trainer mismatch: truncated or masked weights")
    is_level: Literal["token", "sequence"] = Field("token",
        description="importance weights per token or per sequence")
    is_cap: float = Field(2.0, gt=0, description="cap of the importance weights")
    behaviour_mode: Literal["truncate", "mask"] = Field("truncate", description=(
        "decoupled PPO: truncate behaviour weights at is_cap, or drop tokens above it"))
    value_coef: float = Field(0.5, ge=0, description="weight of the value loss (critic)")
    value_clip: float | None = Field(None, description="clip range of the value loss; None disables")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (GAE)")
    turn_credit: Literal["broadcast", "discounted"] = Field("broadcast", description=(
        "multi-turn credit: broadcast = the episode's return for every turn; discounted = each turn's "
        "discounted return over the remaining turns (docs/algorithms.md)"))
    turn_gamma: float = Field(1.0, ge=0, le=1, description="discount per turn (turn_credit=discounted)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")

    @model_validator(mode="after")
    def _clip_defaults(self) -> "AlgoConfig":
        # GSPO's sequence ratio lives within ~1e-3 of 1; PPO's token ratio within ~0.2.
        lo, hi = (3e-4, 4e-4) if self.loss == "gspo" else (0.2, 0.2)
        if self.clip_low is None:
            self.clip_low = lo
        if self.clip_high is None:
            self.clip_high = hi
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"algo.dual_clip must be > 1 (got {self.dual_clip}); None disables it")
        return self


class SFTConfig(_Section):
    """Supervised warm-start on the task's reference answers."""
    steps: int = Field(0, ge=0, description="most warm-start steps; 0 skips the warm-start")
    target_reward: float | None = Field(None, description=(
        "stop early once the greedy reward on held-out TRAINING tasks reaches this"))
    check_every: int = Field(50, ge=1, description="warm-start steps between target checks")
    check_size: int = Field(100, ge=1, description="training tasks held out for the target check")
    batch_size: int = Field(64, ge=1, description="examples per warm-start step")
    lr: float = Field(1e-3, gt=0, description="warm-start learning rate")


class LoopConfig(_Section):
    steps: int = Field(50, ge=0, description="RL training steps")
    batch_size: int = Field(16, ge=1, description="groups (tasks) per training step")
    max_staleness: int = Field(0, ge=0, description="0 = synchronous on-policy")
    eval_every: int = Field(0, ge=0, description="0 = only initial and final evaluation")
    eval_temperature: float = Field(0.0, ge=0, description="0 = greedy held-out evaluation")
    eval_sampled: bool = Field(False, description="also evaluate at the rollout temperature")
    checkpoint_every: int = Field(0, ge=0,
        description="steps between checkpoints; 0 = none (final/ is always written)")
    keep_checkpoints: int | None = Field(3, ge=1, description=(
        "checkpoints kept: the newest this many (null = all), plus the best by held-out reward (keep_best)"))
    keep_best: bool = Field(True, description=(
        "also keep the checkpoint of the highest held-out reward (checkpoints at evaluated steps)"))
    seed: int = Field(0, description="seed of task order, sampling and the tiny model")
    time_limit_s: float | None = Field(None, gt=0, description="stop RL after this many seconds")
    concurrency: int | None = Field(None, ge=1, description=(
        "groups in flight at most; default batch_size * (max_staleness + 1)"))
    buffer_size: int | None = Field(None, ge=1, description=(
        "scored groups the buffer holds; default batch_size * (max_staleness + 1)"))
    partial_rollouts: bool = Field(True, description=(
        "new weights interrupt running generations (tokens record their version); "
        "false: engines take new weights only between requests"))

    @model_validator(mode="after")
    def _fits(self) -> "LoopConfig":
        cap = staleness.capacity(self.batch_size, self.max_staleness)
        if self.buffer_size is not None and self.buffer_size < self.batch_size:
            raise ValueError(f"loop.buffer_size ({self.buffer_size}) must hold one batch "
                             f"(loop.batch_size={self.batch_size})")
        if self.concurrency is not None and self.concurrency > cap:
            raise ValueError(f"loop.concurrency ({self.concurrency}) exceeds what the staleness rule can ever "
                             f"admit (batch_size * (max_staleness + 1) = {cap}); lower it or raise max_staleness")
        return self


class EndpointConfig(_Section):
    """The OpenAI-compatible endpoint that external agents call (env.name=agent; see docs/agents.md)."""
    host: str = Field("127.0.0.1", description="address the endpoint listens on (started and stopped with the run)")
    port: int = Field(0, ge=0, le=65535, description="its port; 0 = a free one (agents are told the base_url)")
    model: str = Field("policy", description="the model name it serves (what agents pass as model=)")
    episode_timeout_s: float = Field(600.0, gt=0, description=(
        "deadline of one agent episode, start to return; an agent past it is a counted failure and its key "
        "is refused from then on"))
    tools_in_prompt: bool = Field(True, description=(
        "describe a request's tools in the prompt (the chat template's rendering, or a Hermes system "
        "message); false for small models that learned their tools (calls are parsed either way)"))


class EnvConfig(_Section):
    """The environment pool: multi-turn episodes (see docs/environments.md)."""
    name: str | None = Field(None, description=(
        "environment: a builtin (tools, guess_number, textarena, agent) or a dotted path pkg.module:Factory; "
        "empty = single-turn rollouts"))
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory")
    max_turns: int = Field(4, ge=1, le=64, description="model turns per episode (rollout.max_new_tokens is per turn)")
    max_tokens: int | None = Field(None, ge=1, description=(
        "completion tokens per episode, the policy's and the environment's together; default: the context"))
    max_observation_tokens: int = Field(256, ge=1, description=(
        "an observation longer than this is cut, with a marker, and counted (truncated_observation)"))
    observation_template: str = Field("{observation}", description=(
        "how an observation is written into the sequence when the tokenizer has no chat template "
        "(or data.chat_template is false)"))
    observation_role: str = Field("tool", description="chat role of observations (chat templates)")
    concurrency: int = Field(64, ge=1, description="environment instances in use at once (per environment type)")
    reset_timeout_s: float = Field(30.0, gt=0, description="deadline of one reset")
    step_timeout_s: float = Field(30.0, gt=0, description="deadline of one step (a tool call inside it included)")
    tool_timeout_s: float = Field(10.0, gt=0, description="deadline of one tool call")
    retries: int = Field(2, ge=0, description="retries of a reset that failed (transient failures), with backoff")
    backoff_s: float = Field(0.05, ge=0, description="first retry's wait; doubles per retry")
    breaker_failures: int = Field(5, ge=1, description=(
        "consecutive failures after which a tool or environment is quarantined"))
    breaker_cooldown_s: float = Field(30.0, gt=0, description="how long a quarantine lasts before one trial call")
    on_failure: Literal["retry", "drop"] = Field("retry", description=(
        "a failed episode: retry it (a fresh instance and seed, up to episode_attempts), or drop its "
        "group and draw a new task for the slot; a group is trained whole or not at all"))
    episode_attempts: int = Field(2, ge=1, le=8, description="tries of one episode under on_failure=retry")
    max_failed_groups: int = Field(64, ge=1, description=(
        "groups in a row that fail before the run stops, naming the environment's last error"))
    tool_format: Literal["auto", "hermes", "llama3", "plain"] = Field("auto", description=(
        "how tool calls are written by the model (tools environment)"))
    endpoint: EndpointConfig = Field(EndpointConfig(), description=(
        "the OpenAI-compatible endpoint of agent episodes (env.name=agent)"))


class LaunchConfig(_Section):
    """Where the roles run (see docs/architecture.md, Launch)."""
    placement: Literal["colocated", "disaggregated"] = Field("colocated", description=(
        "colocated: trainer rank i and engine i share device i (one trainer rank and one engine run in "
        "this process); disaggregated: trainer ranks and engines on devices of their own, in processes"))
    trainer_ranks: int = Field(1, ge=1, description=(
        "data-parallel trainer processes (one per GPU); more than 1 shards the model with FSDP2"))
    engines: int = Field(1, ge=1, description="rollout engine workers (one per GPU)")
    weight_sync: Literal["auto", "shm", "ipc", "broadcast"] = Field("auto", description=(
        "auto: broadcast (NCCL) to engines on GPUs of their own, ipc to an engine on a trainer's GPU, "
        "shm on CPU; broadcast on CPU uses gloo"))
    # 128 MiB: with a streamed publish only the last bucket travels after the optimizer step.
    weight_bucket_mb: float = Field(128.0, gt=0, description="broadcast: MiB per bucket")
    engine_threads: int = Field(1, ge=1, description="CPU threads of each engine process (disaggregated)")
    trainer_threads: int = Field(1, ge=1, description="CPU threads of each trainer process (disaggregated)")
    timeout_s: float = Field(300.0, gt=0, description=(
        "deadline of every cross-role wait (a trainer call, the wait for a step's groups, an engine's start "
        "and weights); a wait's deadline grows to 4x the longest completed wait of its kind, so a stuck "
        "run stops within minutes and a slow one is not cut. Past it, every role's stacks go to its log"))
    max_restarts: int = Field(3, ge=0, description=(
        "engine processes that die are restarted, their work in flight sent again: at most this many "
        "restarts in the run, then the death stops the run (needs weight_sync shm or ipc)"))
    collective_timeout_s: float = Field(120.0, gt=0, description=(
        "deadline of one collective (trainer ranks, weight broadcast): a dead rank stops the run after this"))
    backend: Literal["local", "ray"] = Field("local", description=(
        "local: roles on this machine (threads or child processes); ray: every trainer rank and engine a Ray "
        "actor in one placement group, weights by broadcast (docs/cluster.md); needs pip install 'conveyor[ray]'"))
    ray_address: str = Field("", description=(
        "backend=ray: the address of a running Ray cluster (e.g. 10.0.0.1:6379 or auto); empty starts a "
        "local Ray instance for the run"))
    ray_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "backend=ray: the placement group strategy of the roles' bundles (SPREAD puts them on different "
        "nodes where it can)"))
    ray_trainer_resources: dict[str, float] = Field(default_factory=dict, description=(
        "backend=ray: extra Ray resources each trainer rank's bundle asks for (e.g. {node_a: 0.1} to pin the "
        "ranks to nodes started with --resources='{\"node_a\": 1}')"))
    ray_engine_resources: dict[str, float] = Field(default_factory=dict, description=(
        "backend=ray: extra Ray resources each engine's bundle asks for (placement=disaggregated)"))

    @property
    def in_process(self) -> bool:
        """One trainer and one engine, both in the controller's process."""
        return self.placement == "colocated" and self.trainer_ranks == 1 and self.engines == 1


SINKS = ("tensorboard", "wandb", "mlflow")


class ObserveConfig(_Section):
    progress: bool = Field(True, description="progress bars and summary on the console")
    tensorboard: bool = Field(True, description=(
        "write TensorBoard event files to <run dir>/tensorboard (listing tensorboard in observe.sinks "
        "says the same)"))
    sinks: list[str] = Field(default_factory=list, description=(
        "metric trackers, any of: " + ", ".join(SINKS) + "; wandb and mlflow also get the resolved "
        "config and the final summary, and need pip install 'conveyor[tracking]'"))
    project: str = Field("conveyor", description="the W&B project and the MLflow experiment of observe.sinks")
    timeline: bool = Field(True, description=(
        "record what every role did when to <run dir>/timeline.json, a trace for ui.perfetto.dev "
        "(one process per role); `conveyor report RUN_DIR` draws it too"))
    log_every: int = Field(0, ge=0, description=(
        "console lines when not a terminal: one per this many steps; 0 = about 20 per phase"))
    traces_per_step: int = Field(8, ge=0, description=(
        "trajectories written to <run dir>/traces.jsonl per step (the best, the worst, random others); "
        "0 = none; read them with `conveyor samples RUN_DIR`"))
    traces_max_mb: float = Field(64.0, gt=0, description="traces.jsonl stops growing at this size")
    eval_samples: int = Field(4, ge=0, description=(
        "completions of the first held-out tasks written per evaluation to <run dir>/eval_samples.jsonl "
        "(the same tasks every time, to compare across steps); `conveyor samples RUN_DIR --eval`"))

    @field_validator("sinks")
    @classmethod
    def _known_sinks(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in SINKS:
                raise ValueError(f"unknown sink {name!r}{did_you_mean(name, list(SINKS))}; "
                                 f"choose from {', '.join(SINKS)}")
        if len(set(v)) < len(v):
            raise ValueError("a sink is listed twice; list each once")
        return v

    @model_validator(mode="after")
    def _tensorboard_agrees(self) -> "ObserveConfig":
        if "tensorboard" in self.sinks and not self.tensorboard:
            raise ValueError("observe.sinks lists tensorboard but observe.tensorboard is false; drop one of them")
        return self


class RunConfig(_Section):
    name: str = Field("default", description="run name (the run directory's prefix)")
    output_dir: str | None = Field(None, description="run directory; default runs/<name>-<timestamp>")
    model: ModelConfig = Field(ModelConfig(), description="the policy model")
    data: DataConfig = Field(DataConfig(), description="tasks: training and held-out prompts with reference answers")
    rollout: RolloutConfig = Field(RolloutConfig(), description="the rollout engine and its sampling")
    reward: RewardConfig = Field(RewardConfig(), description="the reward function")
    trainer: TrainerConfig = Field(TrainerConfig(),
        description="the policy trainer (optimizer, micro-batches, devices)")
    algo: AlgoConfig = Field(AlgoConfig(), description="advantages and the policy loss")
    sft: SFTConfig = Field(SFTConfig(), description="the supervised warm-start before RL")
    loop: LoopConfig = Field(LoopConfig(),
        description="the RL loop: steps, batch, staleness, evaluation, checkpoints")
    env: EnvConfig = Field(EnvConfig(), description="the environment pool (multi-turn episodes, tools)")
    observe: ObserveConfig = Field(ObserveConfig(), description="console, metrics files and trackers")
    launch: LaunchConfig = Field(LaunchConfig(), description="where the roles run (devices, processes, weight sync)")

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.algo.loss == "auto":
            # Stale samples clipped against their behaviour policy stop teaching; decoupled PPO
            # clips against the proximal policy instead, and with one update per batch it costs
            # no extra pass (docs/architecture.md, "Choices measured").
            self.algo.loss = "decoupled_ppo" if self.loop.max_staleness > 0 else "ppo"
        if self.rollout.prefix_cache == "auto":
            streaming = self.loop.partial_rollouts and self.loop.max_staleness > 0
            self.rollout.prefix_cache = ("stale" if streaming else "version") if self.env.name else "off"
        if self.algo.kl_coef > 0 and not self.trainer.reference:
            raise ValueError("algo.kl_coef > 0 needs a reference model: set trainer.reference=true")
        if self.algo.advantage == "gae" and not self.trainer.critic:
            raise ValueError("algo.advantage=gae needs a value model: set trainer.critic=true")
        la = self.launch
        if la.placement == "colocated" and not la.in_process and la.engines != la.trainer_ranks:
            raise ValueError(f"launch.placement=colocated puts engine i beside trainer rank i, so launch.engines "
                             f"({la.engines}) must equal launch.trainer_ranks ({la.trainer_ranks}); "
                             "or use launch.placement=disaggregated")
        return self


DEFAULT_RECIPE = Path(__file__).parent / "recipes" / "default.yaml"
PRETRAINED_RECIPE = Path(__file__).parent / "recipes" / "pretrained.yaml"
# Names `base:` accepts besides a path: the built-in recipes, or nothing (pydantic defaults).
BUILTIN_BASES = {"default": DEFAULT_RECIPE, "pretrained": PRETRAINED_RECIPE}
NO_BASE = ("none", "null", None)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist; give a YAML or TOML file path")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text) or {}
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"recipe {path} is malformed: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def _base_path(recipe: Path, base: Any) -> Path | None:
    if base in NO_BASE:
        return None
    if not isinstance(base, str):
        raise ConfigError(f"recipe {recipe}: base must be 'default', 'none' or a recipe path, got {base!r}")
    if base in BUILTIN_BASES:
        return BUILTIN_BASES[base]
    path = Path(base).expanduser()
    path = path if path.is_absolute() else recipe.parent / path
    if not path.is_file():
        raise ConfigError(f"recipe {recipe}: base {base!r} is not a recipe file ({path} does not exist); "
                          f"give a path relative to the recipe, 'default' or 'none'")
    return path


def read_recipe(path: str | Path) -> tuple[dict[str, Any], Path | None]:
    """A recipe's data with its ``base:`` chain deep-merged under it, and the direct base's path
    (None: the recipe inherits nothing, i.e. the pydantic defaults)."""
    path = Path(path)
    seen: list[Path] = []
    layers: list[dict[str, Any]] = []
    first_base: Path | None = None
    cur: Path | None = path
    while cur is not None:
        if cur.resolve() in seen:
            raise ConfigError(f"recipe {path}: base chain loops back to {cur}; remove one base: key")
        seen.append(cur.resolve())
        data = _read_file(cur)
        nxt = _base_path(cur, data.pop("base", None))
        if cur == path:
            first_base = nxt
        layers.append(data)
        cur = nxt
    merged: dict[str, Any] = {}
    for layer in reversed(layers):
        merged = _deep_merge(merged, layer)
    return merged, first_base


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {p} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _section_model(loc: tuple) -> type[BaseModel] | None:
    """The model class holding the field at ``loc`` (a pydantic error location)."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        f = model.model_fields.get(str(part))
        ann = f.annotation if f is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def did_you_mean(word: str, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            model = _section_model(e["loc"])
            hint = did_you_mean(str(e["loc"][-1]), list(model.model_fields)) if model else ""
            where = ".".join(str(x) for x in e["loc"][:-1])
            lines.append(f"{loc}: unknown field{hint}; see `conveyor config {where or 'SECTION'}` for the fields")
        else:
            got = e.get("input")
            got_s = json.dumps(got, default=str)[:60] if not isinstance(got, dict) else "a mapping"
            lines.append(f"{loc or 'config'}: {e['msg']} (got {got_s})")
    return "; ".join(lines)


def recipe_without_file(overrides: list[str]) -> Path:
    """The built-in recipe a command line without a recipe file starts from: the tiny model's
    recipe, or, when it names a model of its own (``model.path=...``), the recipe for pretrained
    models, so the tiny model's hyperparameters never reach a real model."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "model.path" and value.strip() not in ("", "null", "None", "~"):
            return PRETRAINED_RECIPE
    return DEFAULT_RECIPE


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> RunConfig:
    """Validate ``base`` (a mapping), then the recipe at ``path`` (with its own ``base:`` chain)
    merged over it, then the dotted ``overrides``."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = _deep_merge(data, read_recipe(path)[0])
    for item in overrides or []:
        apply_override(data, item)
    return validate(data)


def validate(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def base_config(path: str | Path | None) -> tuple[str, RunConfig]:
    """What the recipe at ``path`` inherits: a label and the config of its base alone
    (the pydantic defaults when it names none)."""
    if path is None:
        return "none (pydantic defaults)", RunConfig()
    _, base = read_recipe(path)
    if base is None:
        return "none (pydantic defaults)", RunConfig()
    label = {DEFAULT_RECIPE: "default (the built-in recipe)",
             PRETRAINED_RECIPE: "pretrained (the built-in recipe for pretrained models)"}.get(base, str(base))
    return label, validate(read_recipe(base)[0])


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and k not in _DICT_FIELDS:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Fields whose value is a mapping: compared whole, not key by key.
_DICT_FIELDS = {"options", "kwargs", "vllm_kwargs"}


def config_diff(cfg: RunConfig, base: RunConfig) -> list[tuple[str, Any, Any]]:
    """``(dotted field, base value, value)`` for every field where ``cfg`` differs from ``base``."""
    a, b = _flat(base.model_dump(mode="json")), _flat(cfg.model_dump(mode="json"))
    return [(k, a.get(k), b[k]) for k in b if a.get(k) != b[k] and k != "output_dir"]


def _short_value(v: Any) -> str:
    return json.dumps(v, default=str) if not isinstance(v, str) else v


def format_diff(diff: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k}={_short_value(v)}" for k, _, v in diff) or "nothing"


def sections() -> list[str]:
    return [k for k, f in RunConfig.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]


def describe_section(cfg: RunConfig, name: str) -> str:
    """One section's fields: name, current value, default and description, one field per line."""
    parts = name.split(".")
    model: Any = cfg
    for i, part in enumerate(parts):
        fields = type(model).model_fields if isinstance(model, BaseModel) else {}
        if part not in fields or not isinstance(getattr(model, part), BaseModel):
            choices = [k for k in fields if isinstance(getattr(model, k), BaseModel)]
            where = ".".join(parts[:i]) or "the config"
            known = f"sections: {', '.join(choices)}" if choices else f"{where} has fields only"
            raise ConfigError(f"{'.'.join(parts[:i + 1])} is not a section of {where}"
                              f"{did_you_mean(part, choices)}; {known}")
        model = getattr(model, part)
    doc = (type(model).__doc__ or "").strip()
    parent = RunConfig.model_fields[parts[0]].description if len(parts) == 1 else None
    lines = [f"[{name}] {doc or parent or ''}".rstrip()]
    for key, f in type(model).model_fields.items():
        value = getattr(model, key)
        if isinstance(value, BaseModel):
            lines.append(f"  {key}: a section; see `conveyor config {name}.{key}`")
            continue
        default = f.default_factory() if f.default_factory is not None else f.default
        cur = _short_value(value if not isinstance(value, tuple) else list(value))
        dflt = _short_value(default if not isinstance(default, tuple) else list(default))
        changed = "" if value == default else f"   (default {dflt})"
        lines.append(f"  {name}.{key} = {cur}{changed}")
        if f.description:
            lines += textwrap.wrap(f.description, width=100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
