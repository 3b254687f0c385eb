"""The rollout engine's contract: the engine Protocol over sampling parameters and completions.

``SamplingParams``, ``Completion``, ``StreamChunk`` and ``FinishReason`` are defined in
``conveyor/types.py`` and re-exported here; what they mean for an engine is ``RolloutEngine``'s
contract.
- ``RolloutEngine.generate(prompts, params)`` takes token ids (never text) and returns
  ``params.n`` completions per prompt, in order; every token carries the logprob it was sampled
  with and the policy version that produced it.
- Capabilities are declared, never probed (``streams``, ``counters``, ``cuda_device``,
  ``context_limit``).
- ``EngineWorker`` is the controller's handle on one engine worker.

This module knows nothing of torch, models or schedulers: it is the vocabulary
the loop, the workflows and every engine share.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, runtime_checkable

from conveyor.types import Completion, FinishReason, SamplingParams, StreamChunk

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Completion", "EngineWorker", "FinishReason", "RolloutEngine", "SamplingParams", "StreamChunk",
           "capped_budgets"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the loop and the workflows need from any generation backend.

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
    """

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
    it the work that was in flight.

    ``EngineWorker`` is the controller's handle on one engine worker (a thread
    or a process serving ``rollout.serve.engine_loop``); every launcher
    provides it (``launch.roles``), ``tests/unit/launch/test_handles_conform.py``
    checks it.
    """

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
