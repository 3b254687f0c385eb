"""The wire types: the only data that crosses roles.

- ``Task``: one problem; ``Trajectory``: one sampled completion of one task, token-in/token-out,
  its per-token fields of one length; ``TurnRecord``: one model turn of a multi-turn episode;
  ``Group``: the n samples of one task, explicit (never a positional reshape).
- ``Batch``: what the trainer consumes: token ids plus per-token float fields aligned with them.
- ``SamplingParams``, ``Completion``, ``StreamChunk`` (``FinishReason``): what a generation call
  is asked and answers; the engine's contract over them is ``rollout/api.py``.
- ``Outcome`` (with its ``Problem``): what one trajectory gets of a reward call.

These types know nothing of torch except ``Batch``, whose tensors are built
by the loop just before training.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, Literal, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import numpy
    import torch

    from conveyor.config import RolloutConfig


@dataclass(frozen=True)
class Task:
    """``Task``: one problem. ``prompt`` is the final text given to the tokenizer
    (the data layer already applied any chat template); ``answer`` and ``info``
    are verifier metadata that generation never sees.
    """
    id: str
    prompt: str
    answer: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TurnRecord:
    """One model turn of an episode; ``tool_calls``: names of the
    tools it called; ``env_s``: seconds the environment took to answer; ``error``: the failure
    class of its answer (``"timeout"``, ``"malformed_call"``, ...) or ``""``.

    ``TurnRecord``: one model turn of a multi-turn episode: the policy's tokens
    of the turn are ``completion_ids[start:end]``; the environment's answer
    follows them (loss-masked) up to the next turn's ``start``. ``reward`` is
    the turn's reward from the environment (a process reward; 0 for none).
    """
    start: int
    end: int
    reward: float = 0.0
    tool_calls: tuple[str, ...] = ()
    env_s: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Trajectory:
    """``Trajectory``: one sampled completion of one task, token-in/token-out.
    ``completion_ids``, ``loss_mask``, ``logprobs`` and ``versions`` have the
    same length (one entry per completion token). ``loss_mask[i] == 0`` marks
    tokens the policy did not produce (environment / tool output in multi-turn
    rollouts); their logprob is 0.0 and version -1. ``logprobs`` are the
    behaviour policy's log-probabilities of the sampled tokens, taken from the
    same logits the tokens were sampled from. ``versions[i]`` is the policy
    version whose weights produced token i. ``routed_experts`` (mixture-of-experts
    models, when the engine records them; else None): an integer numpy array
    ``[positions, moe_layers, top_k]``, the experts the engine's routers chose for
    each token it fed through the model, prompt tokens then completion tokens (the
    last completion token is never fed, so ``positions`` is usually
    ``num_tokens - 1``); the trainer replays them (``algo.routing_replay``).
    """
    task: Task
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    loss_mask: tuple[int, ...]
    text: str = ""
    finish_reason: str = "stop"  # "stop" | "length" | "abort"
    reward: float = 0.0
    reward_info: Mapping[str, Any] = field(default_factory=dict)
    turns: int = 1
    timings: Mapping[str, float] = field(default_factory=dict)
    turn_records: tuple[TurnRecord, ...] = ()
    routed_experts: "numpy.ndarray | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n):
            raise ValueError(
                f"Trajectory for task {self.task.id!r}: completion_ids ({n}), logprobs "
                f"({len(self.logprobs)}), versions ({len(self.versions)}) and loss_mask "
                f"({len(self.loss_mask)}) must have one entry per completion token"
            )
        if not math.isfinite(self.reward):
            raise ValueError(f"Trajectory for task {self.task.id!r}: reward {self.reward} is not finite")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def env_return(self) -> float:
        """The sum of the environment's turn rewards (0 for a single-turn trajectory)."""
        return float(sum(t.reward for t in self.turn_records))

    @property
    def policy_versions(self) -> list[int]:
        """The versions of the policy's own tokens (environment tokens carry -1 and are left out)."""
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    @property
    def min_version(self) -> int:
        """Oldest policy version among the policy's own tokens (-1 if none)."""
        own = self.policy_versions
        return min(own) if own else -1

    def with_reward(self, reward: float, info: Mapping[str, Any] | None = None) -> "Trajectory":
        return dataclasses.replace(self, reward=float(reward), reward_info=dict(info or {}))


@dataclass(frozen=True)
class Group:
    """``Group``: the n samples of one task, explicit (never a positional reshape)."""
    task: Task
    trajectories: tuple[Trajectory, ...]

    def __post_init__(self) -> None:
        for t in self.trajectories:
            if t.task.id != self.task.id:
                raise ValueError(f"Group {self.task.id!r} holds a trajectory of task {t.task.id!r}")

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


# The per-token fields the built-in objective puts in a Batch, each a named attribute (``None``
# when a batch has none); a custom loss's own fields are ``Batch.custom`` entries.
BATCH_FIELDS = ("advantages", "behaviour_logprobs", "proximal_logprobs", "ref_logprobs", "old_values", "returns")
COLLATED = ("input_ids", "attention_mask", "loss_mask", "routes")  # a micro-batch's own tensors: no field's name


@dataclass(frozen=True, init=False)
class Batch:
    """Sequences for the trainer.

    input_ids[i]: 1-D long tensor, prompt + completion of sample i.
    loss_mask[i]: 1-D float tensor, same length; 1 where token t is a target
                  the policy produced (0 for the prompt and environment tokens).
    routes[i]:    None, or a long tensor [P_i, moe_layers, top_k] with P_i <= len(input_ids[i]):
                  the experts to use at position t (routing replay); a row with a negative
                  entry, and positions from P_i on, use the trainer's own router.
    advantages, behaviour_logprobs (the engine's), proximal_logprobs, ref_logprobs,
    old_values (the critic's before the update), returns: per-token fields, each a list of
    1-D float tensors aligned with input_ids[i], or None when the batch has none.
    custom[name][i]: a field of a custom loss, aligned the same way.
    The trainer passes every field through to the loss (``trainer.api.LossInputs``).
    ``fields`` is every field present, by name (a live view: ``fields[name] = rows`` adds a
    custom one); ``Batch(ids, mask, {name: rows})`` places each name in its attribute or in custom.
    num_tokens / num_seqs: totals over the WHOLE batch, so a loss can normalise
                  identically however the batch is split into micro-batches.

    ``Batch``: what the trainer consumes: token ids plus per-token float fields, the
    objective's by name (``BATCH_FIELDS``) and a custom loss's in ``custom``, aligned
    with the ids (position t of a field belongs to token t; fields are 0 where
    ``loss_mask`` is 0, and position 0 is never a target), and for routing replay the
    recorded experts per sample.
    """

    input_ids: list["torch.Tensor"]
    loss_mask: list["torch.Tensor"]
    routes: list["torch.Tensor"] | None = None
    advantages: list["torch.Tensor"] | None = None
    behaviour_logprobs: list["torch.Tensor"] | None = None
    proximal_logprobs: list["torch.Tensor"] | None = None
    ref_logprobs: list["torch.Tensor"] | None = None
    old_values: list["torch.Tensor"] | None = None
    returns: list["torch.Tensor"] | None = None
    custom: dict[str, list["torch.Tensor"]] = field(default_factory=dict)

    def __init__(self, input_ids: list["torch.Tensor"], loss_mask: list["torch.Tensor"],
                 fields: Mapping[str, list["torch.Tensor"]] | None = None, routes: list["torch.Tensor"] | None = None,
                 *, custom: Mapping[str, list["torch.Tensor"]] | None = None,
                 **named: list["torch.Tensor"] | None) -> None:
        unknown = sorted(set(named) - set(BATCH_FIELDS))
        if unknown:
            raise TypeError(f"Batch() got an unexpected keyword argument {unknown[0]!r}; a custom field goes in "
                            "fields= or custom=")
        rest: dict[str, list["torch.Tensor"]] = {}
        for name, rows in {**(fields or {}), **(custom or {})}.items():
            if name not in BATCH_FIELDS:
                rest[name] = rows
            elif named.get(name) is not None:
                raise ValueError(f"Batch field {name!r} is given twice: in fields and as {name}=")
            else:
                named[name] = rows
        for key, value in (("input_ids", input_ids), ("loss_mask", loss_mask), ("routes", routes),
                           *((name, named.get(name)) for name in BATCH_FIELDS), ("custom", rest)):
            object.__setattr__(self, key, value)
        self._check()

    def _check(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError("Batch: input_ids and loss_mask must have one entry per sample")
        if self.routes is not None and len(self.routes) != len(self.input_ids):
            raise ValueError(f"Batch: routes has {len(self.routes)} samples, expected {len(self.input_ids)}")
        for name, vals in self.fields.items():
            if len(vals) != len(self.input_ids):
                raise ValueError(f"Batch field {name!r} has {len(vals)} samples, expected {len(self.input_ids)}")

    @property
    def fields(self) -> "BatchFields":
        return BatchFields(self)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        """Number of loss tokens in the whole batch."""
        return int(sum(float(m.sum()) for m in self.loss_mask))

    def select(self, idx: list[int]) -> "Batch":
        def rows(values: list) -> list:
            return [values[i] for i in idx]
        return Batch(rows(self.input_ids), rows(self.loss_mask),
                     routes=None if self.routes is None else rows(self.routes),
                     custom={k: rows(v) for k, v in self.custom.items()},
                     **{name: rows(v) for name in BATCH_FIELDS if (v := getattr(self, name)) is not None})


class BatchFields(MutableMapping):
    """Every per-token field of a ``Batch`` by name: its named fields present, then its custom ones.
    Setting a name adds a custom field; a named field is replaced by building a new Batch."""

    def __init__(self, batch: Batch):
        self._batch = batch

    def __getitem__(self, name: str) -> list["torch.Tensor"]:
        if name in BATCH_FIELDS:
            rows = getattr(self._batch, name)
            if rows is None:
                raise KeyError(name)
            return rows
        return self._batch.custom[name]

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in BATCH_FIELDS if getattr(self._batch, name) is not None)
        yield from self._batch.custom

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, name: str, rows: list["torch.Tensor"]) -> None:
        if name in BATCH_FIELDS:
            raise TypeError(f"Batch.fields[{name!r}] = ...: {name} is a named field of a frozen Batch; "
                            f"build a new one with dataclasses.replace(batch, {name}=...)")
        if len(rows) != len(self._batch):
            raise ValueError(f"Batch field {name!r} has {len(rows)} samples, expected {len(self._batch)}")
        self._batch.custom[name] = rows

    def __delitem__(self, name: str) -> None:
        if name in BATCH_FIELDS:
            raise TypeError(f"del Batch.fields[{name!r}]: {name} is a named field of a frozen Batch; "
                            f"build a new one with dataclasses.replace(batch, {name}=None)")
        del self._batch.custom[name]


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

    ``SamplingParams``, ``Completion``, ``StreamChunk`` (``FinishReason``): what a
    generation call is asked and answers, for every engine and every consumer of
    generation (the controller, the workflows, a judge); the engine's contract over
    them is ``rollout/api.py``, which re-exports them.
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


@dataclasses.dataclass(frozen=True)
class Problem:
    """A failure worth one log line per ``key``: ``message`` is complete; ``traceback`` is the
    text of a raise; ``exc`` the exception, only in the process that caught it."""
    key: str
    message: str
    traceback: str = ""
    exc: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)

    def portable(self) -> Problem:
        """The same problem without the exception object (which may not pickle)."""
        return dataclasses.replace(self, exc=None)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one trajectory gets: ``reward`` and ``info`` (its ``reward_info``), and when it is
    a fallback, the counter it falls under (``failure``) and what to log (``problem``).

    ``Outcome`` (with its ``Problem``): what one trajectory gets of a reward call,
    as it crosses from a reward worker process (``reward/calls.py`` makes them and
    re-exports them).
    """
    reward: float
    info: dict[str, Any]
    failure: str | None = None
    problem: Problem | None = None
