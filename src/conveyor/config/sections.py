"""The sections of a run's configuration, one per role, composed into ``RunConfig``."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from conveyor import staleness
from conveyor.config import overlap
from conveyor.config.base import ConfigError, _Section, did_you_mean
from conveyor.config.estimators import ESTIMATORS, estimator
from conveyor.config.replay import ReplayConfig
from conveyor.config.lora import LoraConfig
from conveyor.config.reward import JudgeConfig, RewardComponentConfig, RewardConfig

__all__ = ["AlgoConfig", "ConfigError", "DataConfig", "EndpointConfig", "EnvConfig", "JudgeConfig", "LaunchConfig",
           "LoopConfig", "ModelConfig", "ObserveConfig", "RewardComponentConfig", "RewardConfig", "RolloutConfig",
           "RunConfig", "SFTConfig", "SINKS", "TinyModelConfig", "TrainerConfig"]


def on_off(v: Any) -> Any:
    """YAML reads ``on`` / ``off`` as booleans: give an auto/on/off field its word back."""
    return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class TinyModelConfig(_Section):
    """The locally built Llama-architecture model used when ``model.path`` is empty."""
    hidden_size: int = Field(128, gt=0, description="width of the tiny model")
    num_layers: int = Field(4, gt=0, description="decoder layers")
    num_heads: int = Field(4, gt=0, description="attention heads")
    num_kv_heads: int = Field(2, gt=0, description="key/value heads (grouped-query attention)")
    intermediate_size: int = Field(384, gt=0, description="MLP width")
    max_position_embeddings: int = Field(256, gt=0, description="context length in tokens (prompt + completion)")
    num_experts: int = Field(0, ge=0, description=(
        "0 = dense; > 0 builds a Qwen3-MoE model instead, every layer's MLP this many experts "
        "(docs/algorithms.md, Mixture of experts)"))
    experts_per_token: int = Field(2, ge=1, description="MoE: experts each token is routed to (top-k)")
    moe_intermediate_size: int = Field(128, gt=0, description="MoE: width of each expert's MLP")

    @model_validator(mode="after")
    def _experts_fit(self) -> "TinyModelConfig":
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ValueError(f"model.tiny.experts_per_token ({self.experts_per_token}) exceeds model.tiny.num_experts "
                             f"({self.num_experts}); lower it or add experts")
        return self


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
    dtype: Literal["auto", "native", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "engine weights; auto keeps the checkpoint's dtype; native: bfloat16 where the engine's device computes "
        "it in hardware (a GPU, a CPU with AMX/AVX512-BF16 or Arm BF16), float32 elsewhere, printed at start "
        "(the trainer always keeps fp32 master weights)"))
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
    quantization: Literal["none", "fp8", "int8"] = Field("none", description=(
        "native engine, fast runner: decode from 8-bit copies of the linear layers' weights, re-quantised at "
        "every weight update (per-output-channel scales; embeddings, norms and the LM head stay in rollout.dtype). "
        "fp8: e4m3 weights and per-token activations, FP8 GEMMs (CPU, or a GPU of compute capability 8.9+); "
        "int8: weight-only. Turns algo.importance_sampling to truncated unless it is set (docs/quantized-rollouts.md)"))
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "extra vllm.LLM arguments (gpu_memory_utilization, tensor_parallel_size, enable_sleep_mode, ...)"))
    vllm_weight_sync: Literal["reload", "nccl", "ipc"] = Field("reload", description=(
        "reload: safetensors in /dev/shm + reload_weights; nccl: trainer on its own GPU; ipc: same GPU"))
    remote_url: str | None = Field(None, description="http://host:port of an OpenAI-compatible server")
    remote_model: str | None = Field(None, description="served model name; default: the server's first model")
    remote_weight_sync: Literal["vllm_reload", "vllm_nccl", "sglang_disk", "none"] = Field("none",
        description="how a remote server receives new weights; none = never")
    remote_timeout_s: float = Field(600.0, gt=0, description="deadline of one HTTP request")
    record_experts: bool = Field(False, description=(
        "native engine, mixture-of-experts models: record each token's routed experts in its trajectory "
        "(turned on by algo.routing_replay)"))

    @model_validator(mode="after")
    def _remote_needs_url(self) -> "RolloutConfig":
        if self.engine == "remote" and not self.remote_url:
            raise ValueError("rollout.engine=remote needs rollout.remote_url=http://host:port")
        if self.quantization != "none" and (self.engine != "native" or self.runner == "hf"):
            which = f"rollout.engine={self.engine}" if self.engine != "native" else "rollout.runner=hf"
            raise ValueError(f"rollout.quantization={self.quantization} is done by the native engine's fast runner, "
                             f"not {which}; set rollout.engine=native and rollout.runner=fast (or auto), or "
                             "rollout.quantization=none")
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
    micro_batch_tokens: int = Field(16384, ge=1, description=(
        "token budget of one micro-batch (padded; real tokens with pack_sequences). Left unset, a trainer whose "
        "GPUs no engine uses (launch.placement=disaggregated) starts from 32768; on a GPU the default is "
        "halved before the first step until a probe micro-batch fits (the run says so); a value you set that "
        "does not fit is refused, naming the largest that does"))
    micro_batch_tokens_shared: int | None = Field(None, ge=1, description=(
        "token budget of a micro-batch trained while a colocated engine still holds its KV pool (the parts "
        "loop.accumulate_groups trains during generation); null = micro_batch_tokens"))
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
    pack_sequences: Literal["auto", "on", "off", "shared"] = Field("auto", description=(
        "put a micro-batch's samples end to end in one row without padding (variable-length attention) "
        "and run the vocabulary head only where a token is scored; micro_batch_tokens then counts real "
        "tokens. auto: on a GPU whose torch has variable-length flash attention (not with compile); "
        "on: also on CPU (a causal attention per sample); shared: packed with the prompt of samples "
        "that share it (a group) computed once, each completion attending to it (a masked attention per "
        "group, trainer/packing.py); off: right-padded micro-batches"))
    logprob_chunk_rows: int | None = Field(1024, ge=1, description=(
        "positions per chunk of the logprob head (no float32 copy of the vocabulary logits; on a CPU fewer, "
        "so that a chunk's float32 logits stay within 3 MiB of cache); null = the plain autograd form"))
    compile: bool = Field(False, description=(
        "experimental: torch.compile each decoder layer and the logprob head, fusing the small memory-bound "
        "ops of norms, rotary and activations; the first steps pay for compilation (minutes on a GPU)"))
    autocast_bf16: bool = Field(True, description="bf16 autocast on GPU (ignored on CPU)")
    param_dtype: Literal["auto", "native", "float32", "bfloat16"] = Field("auto", description=(
        "dtype of the linear layers' weights that forward and backward run on (single-device trainer); "
        "the optimizer keeps float32 master weights either way. auto: bfloat16 on a GPU with autocast_bf16 "
        "(bf16 copies of the linear weights under autocast, gradients summed in float32; embeddings, norms "
        "and biases stay float32: autocast's numbers without its per-op weight casts), float32 on CPU (exact); "
        "native: as auto on a GPU, and bfloat16 on a CPU that computes it in hardware (AMX/AVX512-BF16, Arm "
        "BF16), printed at start"))
    kernels: bool = Field(True, description=(
        "on a GPU with Triton, our fused kernels for the logprob head (one read of the logits per pass) "
        "and for RMSNorm, the SwiGLU product and the rotary embedding, with one GEMM for q/k/v and one for "
        "gate/up (Llama/Qwen2/Mistral); false = plain torch ops"))
    parallel: Literal["auto", "fsdp", "replicate"] = Field("auto", description=(
        "several trainer ranks: fsdp shards the weights, gradients and optimizer state over the ranks "
        "(FSDP2: any size of model; each layer's weights gathered for its forward and backward); replicate "
        "keeps the whole model and its optimizer state on every rank, each rank trains its share of a "
        "mini-batch alone and one all-reduce sums the gradients (a model that fits on one device: no "
        "gathers, the single-device trainer's kernels and copies on every rank); auto: replicate on GPUs "
        "where the training state (weights, gradients, AdamW state, the bf16 copy, reference and critic) "
        "takes at most half of every rank's free memory as the ranks start (after any engine on the same "
        "GPU), else fsdp; fsdp on CPU ranks; a resumed run keeps its "
        "checkpoint's kind"))
    fsdp_reshard: Literal["micro-batch", "step"] = Field("micro-batch", description=(
        "several trainer ranks (FSDP2): when a decoder layer's gathered weights are freed. micro-batch: "
        "after its forward and again after its backward (least memory; gathered twice per micro-batch); "
        "step: kept from the step's first forward to its last backward, so each layer is gathered once "
        "per optimizer step (every rank then holds the whole model in the gather dtype during the step)"))
    reference: bool = Field(False, description="keep a frozen reference model (needed for a KL term)")
    critic: bool = Field(False, description="train a value head (needed for GAE / PPO with a critic)")
    critic_lr: float = Field(1e-5, gt=0, description="learning rate of the value head")
    lora: LoraConfig = Field(LoraConfig(), description=(
        "low-rank adapters (LoRA) instead of full fine-tuning; off by default (docs/lora.md)"))
    ppo_epochs: int = Field(1, ge=1, description="passes over each batch")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per pass")
    profile_steps: list[int] = Field(default_factory=list, description=(
        "train() calls (0-based loop steps) to record with torch.profiler: a trace for chrome://tracing or "
        "Perfetto and a table of the top operators, per rank, in profile_dir"))
    profile_dir: str | None = Field(None, description="where profile_steps write; default <run dir>/profile")

    _on_off = field_validator("pack_sequences", mode="before")(classmethod(lambda cls, v: on_off(v)))

    @field_validator("profile_steps")
    @classmethod
    def _steps_not_negative(cls, v: list[int]) -> list[int]:
        if any(s < 0 for s in v):
            raise ValueError(f"steps are 0-based loop steps, got {v}; list steps >= 0")
        return v


class AlgoConfig(_Section):
    advantage: str = Field("grpo", description=(
        f"advantage estimator: {', '.join(ESTIMATORS)} (conveyor.config.estimators, one row each)"))
    loss: Literal["auto", "ppo", "gspo", "decoupled_ppo"] = Field("auto", description=(
        "auto: decoupled_ppo when loop.max_staleness > 0 or loop.replay is on (the ratio against the policy being trained, "
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
    importance_sampling: Literal["none", "truncated", "masked"] = Field("none", description=(
        "correct engine/trainer mismatch: truncated or masked weights; left unset, truncated when "
        "rollout.quantization is fp8 or int8, else none"))
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
    routing_replay: bool = Field(False, description=(
        "mixture-of-experts models: the trainer's forward uses the experts the engine's routers chose for "
        "each token (recorded in the trajectory) instead of its own router's top-k; needs the native "
        "engine's Hugging Face runner and single-turn rollouts (docs/algorithms.md, routing replay)"))
    dynamic_sampling: bool = Field(False, description=(
        "DAPO's dynamic sampling: a group whose samples all score alike (no learning signal) is dropped and "
        "its slot given a new task, so every trained group carries signal (docs/algorithms.md, DAPO)"))
    max_draws_per_step: int = Field(8, ge=1, description=(
        "dynamic sampling: groups one training step may draw, as a multiple of loop.batch_size; a step that "
        "needs more stops the run (the task is solved or too hard); at least 2"))
    overlong_filter: bool = Field(False, description=(
        "DAPO's overlong filtering: a sample that hit rollout.max_new_tokens without ending gets loss mask 0 "
        "(its reward still counts in its group's baseline)"))
    overlong_buffer: int = Field(0, ge=0, description=(
        "DAPO's soft overlong penalty: the last this many tokens before rollout.max_new_tokens cost reward "
        "linearly, up to overlong_penalty at the budget; 0 = off"))
    overlong_penalty: float = Field(1.0, ge=0, description="the soft overlong penalty's factor (its size at the budget)")

    @field_validator("advantage")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        estimator(v)  # one line naming the choices
        return v

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
    time_limit_s: float | None = Field(None, gt=0, description=(
        "stop RL after this many wall-clock seconds of the RL loop (mid-run evaluations and checkpoints "
        "count; checked before each step, so the step in flight finishes)"))
    concurrency: int | None = Field(None, ge=1, description=(
        "groups in flight at most; default batch_size * (max_staleness + 1)"))
    buffer_size: int | None = Field(None, ge=1, description=(
        "scored groups the buffer holds; default batch_size * (max_staleness + 1)"))
    partial_rollouts: bool = Field(True, description=(
        "new weights interrupt running generations (tokens record their version); "
        "false: engines take new weights only between requests"))
    accumulate_groups: int = Field(0, ge=0, description=(
        "runs with one optimizer step per batch: the trainer runs forward and backward on every "
        "this many scored groups as they arrive, while the engines finish the rest, and steps once the "
        "batch is in (the same gradient, docs/algorithms.md; streaming, the new version is published "
        "that much sooner); 0 = wait for the whole batch"))
    accumulate_sms: int = Field(0, ge=0, description=(
        "with accumulate_groups on a GPU the engine shares: the parts trained while the engine still "
        "decodes run on this many of the GPU's SMs (a CUDA green context), the rest left to the decode "
        "steps (trainer/sm_share.py); 0 = all SMs"))
    replay: ReplayConfig = Field(ReplayConfig(), description=(
        "reuse of recent high-signal groups beside each step's fresh ones (docs/algorithms.md, Trajectory reuse)"))

    @model_validator(mode="after")
    def _fits(self) -> "LoopConfig":
        cap = staleness.capacity(self.batch_size, self.max_staleness)
        if self.buffer_size is not None and self.buffer_size < self.batch_size:
            raise ValueError(f"loop.buffer_size ({self.buffer_size}) must hold one batch "
                             f"(loop.batch_size={self.batch_size})")
        if self.concurrency is not None and self.concurrency > cap:
            raise ValueError(f"loop.concurrency ({self.concurrency}) exceeds what the staleness rule can ever "
                             f"admit (batch_size * (max_staleness + 1) = {cap}); lower it or raise max_staleness")
        if self.replay.fraction > 0 and self.replay.per_step(self.batch_size) == 0:
            raise ValueError(f"loop.replay.fraction ({self.replay.fraction}) x loop.batch_size ({self.batch_size}) "
                             "is under one group, so nothing is replayed; raise loop.replay.fraction or set it to 0")
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
        "data-parallel trainer processes (one per GPU); more than 1 runs whole-model replicas or FSDP2 "
        "shards, as trainer.parallel says"))
    engines: int = Field(1, ge=1, description="rollout engine workers (one per GPU)")
    weight_sync: Literal["auto", "shm", "ipc", "broadcast"] = Field("auto", description=(
        "auto: broadcast (NCCL) to engines on GPUs of their own, ipc to an engine on a trainer's GPU, "
        "shm on CPU; broadcast on CPU uses gloo"))
    # 128 MiB: with a streamed publish only the last bucket travels after the optimizer step.
    weight_bucket_mb: float = Field(128.0, gt=0, description="broadcast: MiB per bucket")
    engine_threads: int = Field(1, ge=1, description="CPU threads of each engine process (disaggregated)")
    trainer_threads: int = Field(1, ge=1, description=(
        "CPU threads of each trainer process (disaggregated), and of the one process on a GPU (in-process)"))
    timeout_s: float = Field(300.0, gt=0, description=(
        "deadline of every cross-role wait (a trainer call, the wait for a step's groups, an engine's start "
        "and weights); a wait's deadline grows to 4x the longest completed wait of its kind, so a stuck "
        "run stops within minutes and a slow one is not cut. Past it, every role's stacks go to its log"))
    max_restarts: int = Field(3, ge=0, description=(
        "engine processes that die are restarted, their work in flight sent again: at most this many "
        "restarts in the run, then the death stops the run (on a weight broadcast group the group re-forms "
        "around the replacement)"))
    standby_engines: bool = Field(True, description=(
        "local engine processes: each keeps a standby process with the engine's imports done (about 0.4 GB "
        "of host memory, no device memory), started once the engines are ready, so a dead engine is replaced "
        "in a fraction of a second instead of the seconds a new process takes to import torch and "
        "transformers; off: a restart starts a new process (only with max_restarts > 0)"))
    time_share: Literal["auto", "on", "off"] = Field("auto", description=(
        "synchronous runs with the engine on the trainer's GPU: the engine's KV pool is released while the "
        "trainer trains and taken back before generation (the trainer may then use trainer.micro_batch_tokens "
        "of that memory); auto = on for the native engine on a shared GPU when trainer.micro_batch_tokens does not "
        "fit beside the pool (one probe before the first step), off otherwise and on CPU"))
    collective_timeout_s: float = Field(120.0, gt=0, description=(
        "deadline of one collective (trainer ranks, weight broadcast): a dead rank stops the run after this; "
        "also how long a weight broadcast group waits for a restarted engine to join it again"))
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
    ray_reward_resources: dict[str, float] = Field(default_factory=dict, description=(
        "reward.executor=ray: extra Ray resources each reward worker's bundle (1 CPU) asks for, e.g. "
        "{node_b: 0.1} to put them on a node, {GPU: 1} for a reward model on a GPU of its own"))
    ray_reward_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description=(
        "reward.executor=ray: the placement group strategy of the reward workers' bundles (SPREAD: over "
        "the nodes)"))

    _on_off = field_validator("time_share", mode="before")(classmethod(lambda cls, v: on_off(v)))

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
    def _algo_fits(self) -> "RunConfig":
        a, n, budget = self.algo, self.rollout.n, self.rollout.max_new_tokens
        if a.kl_in_reward and a.kl_coef == 0:
            raise ValueError("algo.kl_in_reward=true subtracts nothing with algo.kl_coef=0; set algo.kl_coef > 0 "
                             "(and trainer.reference=true), or algo.kl_in_reward=false")
        if a.dynamic_sampling and n < 2:
            raise ValueError("algo.dynamic_sampling with rollout.n=1 can never fill a batch (a group of one sample "
                             "always scores alike and is dropped); raise rollout.n to 2 or more, or set "
                             "algo.dynamic_sampling=false")
        if a.dynamic_sampling and a.max_draws_per_step < 2:
            raise ValueError(f"algo.max_draws_per_step={a.max_draws_per_step} leaves no draw to replace a dropped "
                             "group (algo.dynamic_sampling); set it to 2 or more")
        if a.overlong_buffer >= budget:
            raise ValueError(f"algo.overlong_buffer ({a.overlong_buffer}) must be below rollout.max_new_tokens "
                             f"({budget}), or every completion is penalised; lower it")
        if a.overlong_buffer > 0 and self.env.name:
            raise ValueError("algo.overlong_buffer measures single-turn completions against rollout.max_new_tokens; "
                             "with env.name set it to 0 (algo.overlong_filter works with episodes)")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.rollout.quantization != "none" and "importance_sampling" not in self.algo.model_fields_set:
            # 8-bit rollouts widen the engine/trainer gap; the ratio corrects it (docs/quantized-rollouts.md).
            self.algo.importance_sampling = "truncated"
        if self.algo.loss == "auto":
            # Stale samples clipped against their behaviour policy stop teaching; decoupled PPO
            # clips against the proximal policy instead, and with one update per batch it costs
            # no extra pass (docs/architecture.md, "Choices measured").
            stale = self.loop.max_staleness > 0 or self.loop.replay.enabled  # replayed groups are stale too
            self.algo.loss = "decoupled_ppo" if stale else "ppo"
        if self.loop.replay.enabled and self.algo.loss != "decoupled_ppo" and self.algo.importance_sampling == "none":
            raise ValueError(f"loop.replay needs an importance-corrected loss, not algo.loss={self.algo.loss} without "
                             "importance sampling: set algo.loss=decoupled_ppo (or auto), or algo.importance_sampling="
                             "truncated")
        if self.rollout.prefix_cache == "auto":
            streaming = self.loop.partial_rollouts and self.loop.max_staleness > 0
            self.rollout.prefix_cache = ("stale" if streaming else "version") if self.env.name else "off"
        if self.algo.routing_replay:
            self._check_routing_replay()
        if self.algo.kl_coef > 0 and not self.trainer.reference:
            raise ValueError("algo.kl_coef > 0 needs a reference model: set trainer.reference=true")
        if estimator(self.algo.advantage).critic and not self.trainer.critic:
            raise ValueError(f"algo.advantage={self.algo.advantage} needs a value model: set trainer.critic=true")
        lo = self.trainer.lora
        if lo.enabled and lo.publish == "adapter" and self.rollout.engine != "native":
            raise ValueError(f"trainer.lora.publish=adapter needs rollout.engine=native ({self.rollout.engine} "
                             "takes full weights only); set trainer.lora.publish=merged")
        if lo.enabled and lo.publish == "adapter" and self.sft.steps > 0:
            raise ValueError("trainer.lora.publish=adapter cannot carry the warm start's full weights; "
                             "set trainer.lora.publish=merged or sft.steps=0")
        overlap.check(self)
        la = self.launch
        if self.reward.executor == "ray" and la.backend != "ray":
            raise ValueError("reward.executor=ray runs the reward workers as Ray actors and needs "
                             "launch.backend=ray; or use reward.executor=process")
        if la.placement == "colocated" and not la.in_process and la.engines != la.trainer_ranks:
            raise ValueError(f"launch.placement=colocated puts engine i beside trainer rank i, so launch.engines "
                             f"({la.engines}) must equal launch.trainer_ranks ({la.trainer_ranks}); "
                             "or use launch.placement=disaggregated")
        return self

    def _check_routing_replay(self) -> None:
        """algo.routing_replay: what can record experts, before the run (a model.path's own config is
        checked when the run starts, run/session.py)."""
        if self.model.path is None and self.model.tiny.num_experts == 0:
            raise ValueError("algo.routing_replay needs a mixture-of-experts model, and the tiny model is dense: "
                             "set model.tiny.num_experts (e.g. 8), or give an MoE model.path")
        r = self.rollout
        if r.engine != "native" or r.runner == "fast" or r.quantization != "none":
            raise ValueError("algo.routing_replay needs experts recorded by the native engine's Hugging Face "
                             "runner: set rollout.engine=native, rollout.runner=auto or hf and rollout.quantization="
                             f"none (got {r.engine}, runner {r.runner}, quantization {r.quantization})")
        if self.env.name:
            raise ValueError("algo.routing_replay covers single-turn rollouts; multi-turn episodes (env.name="
                             f"{self.env.name}) carry no recorded experts: set algo.routing_replay=false")
        self.rollout.record_experts = True
