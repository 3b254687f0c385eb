"""Requests and the admission scheduler of the native engine.

- A ``Request`` is one sequence being generated; ``StopRule.finish_reason(request)`` decides,
  right after a token is appended, whether it is done.
- ``Scheduler``: a FIFO ``waiting`` queue and the ``running`` list (the runner's row order);
  ``admit``, ``retire`` and ``preempt`` are the only ways requests move. Admission stays FIFO
  and comes in waves with a refill threshold; samples of one prompt are admitted together.

It knows nothing of tensors or models: the engine turns admissions into
prefills and retirements into row selections.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Request:
    """A ``Request`` is one sequence being generated: its prompt, its own token budget
    (already capped by the model's context), and the tokens, logprobs and versions
    produced so far, plus its finish reason once it has one.
    """
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    key: int = 0  # its random stream (``sampling.request_key``): its draws depend on nothing else
    kv: Any = None  # the paged runner's per-sequence state (block ids), None while not in its cache
    routes: list = field(default_factory=list)  # recorded experts, [positions, layers, k] pieces (MoE)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, version: int) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)


class StopRule:
    """When a request is finished, given the token it just appended.

    ``StopRule.finish_reason(request)`` decides, right after a token is appended,
    whether the request is done: a stop token, then a stop string found in the tail
    of the decoded completion, then the token budget.
    """

    # Extra tokens decoded before the window, so tokenizers that render a token's
    # leading space or a multi-byte character differently at the start of a
    # decode cannot hide a stop string from the window's end.
    _MARGIN = 4

    def __init__(self, stop_token_ids: set[int], stop_strings: tuple[str, ...], tokenizer=None):
        if stop_strings and tokenizer is None:
            raise ValueError("SamplingParams.stop_strings need a tokenizer; construct NativeEngine with tokenizer=...")
        self.stop_token_ids = stop_token_ids
        self.stop_strings = stop_strings
        self.tokenizer = tokenizer
        # A stop string that ends at the newest token spans at most len(s) tokens,
        # since every token decodes to at least one character.
        self._window = max((len(s) for s in stop_strings), default=0) + self._MARGIN

    def finish_reason(self, req: Request) -> str | None:
        if req.token_ids[-1] in self.stop_token_ids:
            return "stop"
        if self.stop_strings:
            tail = self.tokenizer.decode(req.token_ids[-self._window:], skip_special_tokens=True)
            if any(s in tail for s in self.stop_strings):
                return "stop"
        if len(req.token_ids) >= req.max_new_tokens:
            return "length"
        return None


class Scheduler:
    """- ``Scheduler`` keeps a FIFO ``waiting`` queue and the ``running`` list, whose
      order is the row order of the model runner's batch. ``admit()`` moves requests
      from waiting to the end of running; ``retire()`` drops finished requests from
      running and returns the row indices that stay. ``preempt(tail)`` moves the last
      running requests back to the front of waiting (the paged runner ran out of KV
      blocks; their tokens so far are kept and recomputed on re-admission).
    - ``admit(fits)``: the optional ``fits(request)`` stops a wave at the first
      request the KV budget cannot take, so admission stays FIFO.

    Admission policy (admission waves with a refill threshold): new requests are
    admitted when the batch is empty, or when at least ``refill`` slots are free
    (``refill`` defaults to a quarter of ``max_batch``), or when every waiting request
    fits. Each admission costs a prefill plus one copy of the running KV cache (to
    merge the rows), so admitting in waves amortises that copy over several slots
    while still refilling long before the batch drains. Samples of one prompt are
    admitted next to each other so they can share one prefill.
    """
    def __init__(self, requests: list[Request], max_batch: int, refill: int | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.refill = max(1, refill if refill is not None else max_batch // 4)
        self.waiting: deque[Request] = deque(requests)
        self.running: list[Request] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, fits: Callable[[Request], bool] | None = None) -> list[Request]:
        """Admit a wave; ``fits`` (the paged runner's KV budget) may stop it early, in FIFO order."""
        free = self.max_batch - len(self.running)
        if not self.waiting or free <= 0:
            return []
        if self.running and free < min(self.refill, len(self.waiting)):
            return []
        admitted = []
        while self.waiting and len(admitted) < free and (fits is None or fits(self.waiting[0])):
            admitted.append(self.waiting.popleft())
        self.running.extend(admitted)
        return admitted

    def preempt(self, tail: list[Request]) -> None:
        """Move ``tail`` (the last requests of ``running``, last first) back to the front of ``waiting``."""
        if not tail:
            return
        self.running = self.running[:len(self.running) - len(tail)]
        for req in tail:
            self.waiting.appendleft(req)

    def retire(self) -> list[int]:
        keep = [i for i, r in enumerate(self.running) if r.finish_reason is None]
        self.running = [self.running[i] for i in keep]
        return keep
