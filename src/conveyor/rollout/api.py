"""The rollout engine's contract: sampling parameters, completions, and the engine Protocol.

Contract
- ``RolloutEngine.generate(prompts, params)`` takes token ids (never text: rollouts
  are token-in/token-out) and returns, for each prompt in order, ``params.n``
  ``Completion`` objects in sample order.
- Every completion token carries the log-probability it was sampled with and the
  policy version whose weights produced it. The logprob is
  ``log_softmax(logits / T)`` of the temperature-scaled distribution BEFORE top-k /
  top-p truncation (``log_softmax(logits)`` for greedy, ``T == 0``), computed in
  float32 from the same logits the token was sampled from, because that is exactly
  what the trainer recomputes. With ``eos_bias`` the bias is part of those logits, so
  the reported logprob is of the biased distribution (a trainer comparing against
  unbiased logits will see the difference at EOS and every other token's
  normaliser; ``eos_bias`` is for benchmark length shaping, not for training runs
  that check logprob parity).
- A stop token (EOS always counts, plus ``stop_token_ids``) is kept as the last
  completion token, with its logprob, because the policy produced it and the
  trainer must learn to emit it. A stop string is kept too: generation stops at the
  first token whose decoded completion text contains the string, and that token
  stays in ``token_ids``; ``text`` may therefore run past the stop string by the
  rest of that token.
- ``text`` is ``tokenizer.decode(token_ids, skip_special_tokens=True)``, or ``""``
  when the engine has no tokenizer.
- ``finish_reason``: ``"stop"`` (stop token or stop string), ``"length"``
  (``max_new_tokens`` reached, or the model's context is full), ``"abort"`` (the
  request was cancelled before it finished; reserved for engines that can cancel).
- ``update_weights`` copies tensors in place into the live model and sets
  ``version``; tokens sampled afterwards record the new version.
- Capabilities are declared, never probed: ``streams`` (``generate_stream``,
  continuous batching over ``StreamChunk``s, is available), ``counters``
  (decode-step totals, empty for engines that keep none), ``cuda_device``
  (the GPU a weight copy is queued on, None when ``update_weights`` has
  finished its copy on return), ``context_limit``.
- ``EngineWorker`` is the controller's handle on one engine worker (a thread
  or a process serving ``rollout.serve.engine_loop``); every launcher
  provides it (``launch.roles``), ``tests/unit/launch/test_handles_conform.py``
  checks it.

This module knows nothing of torch, models or schedulers: it is the vocabulary
the loop, the workflows and every engine share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import numpy
    import torch

    from conveyor.config import RolloutConfig

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one ``generate`` call.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_p: nucleus truncation of the temperature-scaled distribution (1.0 = off).
    top_k: keep the k largest logits (0 = off).
    max_new_tokens: completion budget per sample (capped by the model's context).
    stop_token_ids: extra token ids that end a completion (EOS always does).
    stop_strings: strings that end a completion when its decoded text contains them.
    n: completions per prompt (the group size).
    eos_bias: added to the EOS logit(s) before sampling and before the logprob.
    seed: keys the random streams of this call's samples (None: fresh entropy); the
          native engine gives prompt i the streams of prompt 0 of a call seeded seed + i.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    n: int = 1
    eos_bias: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen to tuples so params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(str(s) for s in self.stop_strings))
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if any(s == "" for s in self.stop_strings):
            raise ValueError("SamplingParams.stop_strings must not contain the empty string")

    @classmethod
    def from_config(cls, cfg: "RolloutConfig", **overrides: Any) -> "SamplingParams":
        """Sampling fields of a ``RolloutConfig``; keyword overrides win (e.g. seed, n)."""
        base = dict(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            max_new_tokens=cfg.max_new_tokens, stop_strings=tuple(cfg.stop), n=cfg.n,
            eos_bias=cfg.eos_bias,
        )
        base.update(overrides)
        return cls(**base)


@dataclass
class Completion:
    """One sampled completion; ``token_ids``, ``logprobs`` and ``versions`` align.
    ``routed_experts``: what ``Trajectory.routed_experts`` describes, from an engine that
    records experts (mixture-of-experts models), else None."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    text: str = ""
    routed_experts: "numpy.ndarray | None" = None


@dataclass(frozen=True)
class StreamChunk:
    """Prompts that join a running ``generate_stream`` call; ``tag`` comes back in ``on_done``.
    ``seed``: the chunk's own (its prompt i draws as prompt 0 of a call seeded seed + i), or
    None to continue the call's seed over the prompts numbered so far."""
    tag: Any
    prompts: list[list[int]]
    seed: int | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What the loop and the workflows need from any generation backend."""

    streams: bool
    counters: dict[str, float]
    cuda_device: Any
    context_limit: int | None
    label: str  # what generates, for people: backend, runner, device (logged when a run starts)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt, prompts and samples in order; [] for no prompts."""
        ...

    def update_weights(self, named_tensors: "Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]",
                       version: int) -> None:
        """Copy weights in place (names as in ``model.named_parameters()``) and set ``version``."""
        ...

    @property
    def version(self) -> int:
        """Policy version recorded on tokens sampled from now on."""
        ...

    def close(self) -> None:
        """Release the model and any cache; the engine is unusable afterwards."""
        ...


@runtime_checkable
class EngineWorker(Protocol):
    """The controller's handle on one engine worker. ``send`` queues a ``messages.Generate`` or
    ``Stop``; answers arrive on the outbox the launcher returns with the workers. ``check``
    raises ``RoleError`` naming the worker if it died; ``join`` waits for it to end after a
    ``Stop`` (stopping its process if it does not). ``restart`` replaces a dead worker with a
    new one on the same device and weight route (only where ``restartable``); the caller sends
    it the work that was in flight."""

    engine_id: int
    restartable: bool

    def send(self, message: Any) -> None: ...

    def check(self) -> None: ...

    def restart(self) -> None: ...

    def join(self, timeout: float) -> None: ...


def capped_budgets(prompts: list[list[int]], params: SamplingParams, context_limit: int,
                   vocab_size: int | None) -> list[int]:
    """``max_new_tokens`` capped so prompt + completion fits the context; raise on a bad prompt.

    The one prompt check every engine applies, so all engines reject the same input the same way."""
    budgets = []
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"generate: prompt {i} is empty; give at least one token (e.g. BOS)")
        if len(prompt) >= context_limit:
            raise ValueError(f"generate: prompt {i} has {len(prompt)} tokens but the model context is "
                             f"{context_limit}; shorten the prompt to at most {context_limit - 1} tokens")
        if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab_size}); check the tokenizer")
        budgets.append(min(params.max_new_tokens, context_limit - len(prompt)))
    return budgets
