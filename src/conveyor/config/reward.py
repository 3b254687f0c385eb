"""The reward sections of a run's configuration: the reward, its components and its judge."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator


from conveyor.config.base import _Section


class JudgeConfig(_Section):
    """The generative judge of reward.fn=judge: a frozen model that reads each completion and writes a
    critique ending in a score (docs/reward-models.md, "Generative judges")."""
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

        from conveyor.config.reward_rules import DEFAULT_TEMPLATES, pattern_problem, template_problem
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
    executor: Literal["thread", "process", "ray"] = Field("thread", description=(
        "what runs reward calls: thread = worker threads of the controller (a call past timeout_s is "
        "abandoned, its thread runs on); process = worker processes, each loading the reward itself (calls "
        "run in parallel without the GIL, a call past timeout_s is killed with its process, a crashed worker "
        "is replaced); per-trajectory rewards, and reward models (reward.fn=rm: each worker loads its own copy "
        "on reward.device and scores whole batches); ray = those workers as Ray actors on the cluster (needs "
        "launch.backend=ray; placed by launch.ray_reward_resources and launch.ray_reward_strategy)"))
    max_restarts: int = Field(16, ge=0, description=(
        "executor=process or ray: worker deaths in a row (no call answered in between) survived by starting a "
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
        if self.executor in ("process", "ray") and (self.fn == "judge" or self.fn.startswith(("http://", "https://"))):
            held = "an inference engine" if self.fn == "judge" else "a connection to its server"
            raise ValueError(f"reward.executor={self.executor}: reward.fn={self.fn} scores with {held} that the controller "
                             "holds and a worker process cannot rebuild from the config; use reward.executor=thread")
        if not self.components:
            return self
        if self.fn != "auto" or self.kwargs:
            raise ValueError(f"reward.components replaces reward.fn and reward.kwargs (set: fn={self.fn!r}, "
                             f"kwargs={self.kwargs}); leave reward.fn auto and give each component its own kwargs")
        from conveyor.config.reward_rules import check_parts, parts_of
        try:
            check_parts(parts_of(self.components))
        except ValueError as e:
            raise ValueError(f"reward.components: {e}") from None
        return self
