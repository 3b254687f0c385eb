"""The trainer role's contract: a Batch and a loss function in, new weights out.

- ``LossFn``: ``loss_fn(out, mb, num_tokens, num_seqs) -> (loss, metrics)``, called once per
  micro-batch; it declares what it reads (``needs``) and which samples it gives no term
  (``inert``). ``out`` is a ``LossOutputs``, ``mb`` a ``LossInputs``, both ``[b, L]``.
- ``Trainer``: one trainer (one rank of it). ``TrainerHandle``: the trainer role as a launcher
  provides it, in two surfaces, ``TrainerSteps`` (the loop) and ``TrainerLifecycle`` (``run/``).
- Per-sample results are 1-D CPU float32 tensors aligned with ``batch.input_ids[i]``.

The trainer knows nothing about RL: advantages, clipping, KL and staleness
live in the loss function and the loop. This module holds the protocols and the
types that cross them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Protocol, runtime_checkable

from conveyor.types import BATCH_FIELDS

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from conveyor.transport.messages import Trained
    from conveyor.types import Batch

NORMALISERS = ("tokens", "seqs")


@dataclass(frozen=True)
class LossNeeds:
    """What a loss function reads beyond ``out.logprobs`` and ``mb.loss_mask``.

    entropy:    ``out.entropy`` (one more pass over the vocabulary: off unless asked for).
    values:     ``out.values``: the trainer must have a critic (``trainer.critic=true``).
    fields:     the ``Batch`` fields it reads (``BATCH_FIELDS`` names, e.g. ``ref_logprobs``, or
                custom ones); a batch without one is refused before any forward.
    normaliser: which batch total it divides by, ``"tokens"`` (``num_tokens``) or ``"seqs"``
                (``num_seqs``); a step accumulated part by part (``trainer/accumulation.py``)
                needs it, None leaves the loss to whole-batch steps.
    """

    entropy: bool = False
    values: bool = False
    fields: tuple[str, ...] = ()
    normaliser: Literal["tokens", "seqs"] | None = None

    def __post_init__(self) -> None:
        if self.normaliser is not None and self.normaliser not in NORMALISERS:
            raise ValueError(f"LossNeeds.normaliser={self.normaliser!r}: use 'tokens' (it divides by num_tokens), "
                             "'seqs' (by num_seqs) or None")

    def missing(self, batch: "Batch", critic: bool) -> str | None:
        """What ``batch`` and a trainer with (or without) a ``critic`` lack of these needs, or None."""
        if self.values and not critic:
            return "out.values, and the trainer has no critic: set trainer.critic=true"
        absent = [name for name in self.fields if name not in batch.fields]
        if absent:
            return f"the batch field(s) {', '.join(absent)}, which the batch does not have"
        return None


class _ByName(Mapping):
    """Read a loss's inputs or outputs by name too: its tensors that are set, then its custom ones."""

    def __getitem__(self, name: str) -> "torch.Tensor":
        value = getattr(self, name, None) if name in self._names() else self._custom().get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in self._names() if getattr(self, name) is not None)
        yield from self._custom()

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if f.name != "custom")  # type: ignore[arg-type]

    def _custom(self) -> Mapping[str, "torch.Tensor"]:
        return {}


@dataclass(frozen=True, eq=False)
class LossOutputs(_ByName):
    """The trained models' outputs on one micro-batch.

    - ``out`` is a ``LossOutputs`` (all ``[b, L]``, aligned with ``mb.input_ids``):
        * ``logprobs``: ``logprobs[i, t] = log p(x_t | x_<t)``, i.e.
          ``log_softmax(logits[i, t-1] / temperature)[x_t]``; position 0 and
          padding are 0.0. Carries gradient. Positions before the micro-batch's
          first loss token (the prompt every row shares) are 0.0 too: their
          logits are never computed; packed (``trainer.pack_sequences``), every
          position that is not a loss token is 0.0.
        * ``entropy``: entropy of the same predictive distribution (the one that
          scored token t), only when ``needs.entropy``; 0.0 where ``logprobs`` is.
        * ``values``: critic value for position t, i.e. the critic's output at
          position t-1 (the state before token t was emitted), whenever the
          trainer has a critic; 0.0 at position 0 and padding.
    """

    logprobs: "torch.Tensor"
    entropy: "torch.Tensor | None" = None
    values: "torch.Tensor | None" = None

    @classmethod
    def of(cls, out: "LossOutputs | Mapping[str, torch.Tensor]") -> "LossOutputs":
        """``out`` itself, or the outputs a mapping holds by name."""
        return out if isinstance(out, LossOutputs) else cls(**dict(out))


@dataclass(frozen=True, eq=False, kw_only=True)
class LossInputs(_ByName):
    """One micro-batch of a ``Batch``, padded to ``[b, L]``. The trainer
    always sets ``input_ids`` and ``attention_mask``; a LossInputs made ``of`` a mapping may lack them.

    - ``mb`` is a ``LossInputs``: ``input_ids`` (long, right-padded), ``attention_mask``
      (1 on real tokens), ``loss_mask`` (float), each field of the ``Batch`` under its own
      name (``BATCH_FIELDS``; None where the batch has none) and its custom ones in
      ``custom``, padded with 0, and ``routes`` (routing replay), on the trainer's device.
      Both read by name as mappings too (``out["logprobs"]``, ``mb["advantages"]``, a custom
      field ``mb["adv"]``): what a loss written against the earlier dicts reads.
    """

    loss_mask: "torch.Tensor"
    input_ids: "torch.Tensor | None" = None
    attention_mask: "torch.Tensor | None" = None
    advantages: "torch.Tensor | None" = None
    behaviour_logprobs: "torch.Tensor | None" = None
    proximal_logprobs: "torch.Tensor | None" = None
    ref_logprobs: "torch.Tensor | None" = None
    old_values: "torch.Tensor | None" = None
    returns: "torch.Tensor | None" = None
    routes: "torch.Tensor | None" = None
    custom: Mapping[str, "torch.Tensor"] = field(default_factory=dict)

    @classmethod
    def of(cls, mb: "LossInputs | Mapping[str, torch.Tensor]") -> "LossInputs":
        """``mb`` itself, or the inputs a mapping holds by name (names no field has are custom)."""
        if isinstance(mb, LossInputs):
            return mb
        own = {f.name for f in fields(cls)} - {"custom"}
        return cls(**{k: v for k, v in mb.items() if k in own},
                   custom={k: v for k, v in mb.items() if k not in own})

    def to(self, device: "torch.device") -> "LossInputs":
        """Every tensor on ``device`` (copies that need not wait for the host)."""
        moved = {name: t.to(device, non_blocking=True) for name in self._names()
                 if (t := getattr(self, name)) is not None}
        return LossInputs(**moved, custom={k: v.to(device, non_blocking=True) for k, v in self.custom.items()})

    def _custom(self) -> Mapping[str, "torch.Tensor"]:
        return self.custom


assert set(BATCH_FIELDS) <= {f.name for f in fields(LossInputs)}, "every Batch field reaches the loss by name"


@runtime_checkable
class LossFn(Protocol):
    """``(out: LossOutputs, mb: LossInputs, num_tokens, num_seqs) -> (scalar loss, metrics)``.

    ``needs`` declares what the loss reads (``LossNeeds``). ``inert(batch) -> list[bool]``
    marks samples whose loss terms are zero whatever the policy (a zero advantage
    everywhere); a trainer may leave them out of forward and backward, passing the same
    ``num_tokens`` / ``num_seqs`` (the whole mini-batch's), so the gradient is the same.

    - ``LossFn`` is a callable ``loss_fn(out, mb, num_tokens, num_seqs) -> (loss,
      metrics)`` that declares what it reads (``needs``, a ``LossNeeds``; the trainer checks
      the batch and its own models against it before a step) and which samples it gives
      no term (``inert``). A metric is a float or a 0-d tensor (tensors are read in one
      transfer per mini-batch, sparing the GPU a wait per micro-batch; they are averaged
      over micro-batches weighted by loss tokens). The trainer calls it once per micro-batch and sums the
      gradients of the returned losses, then takes one optimizer step per
      mini-batch. Because ``num_tokens`` / ``num_seqs`` are totals over the whole
      mini-batch, a loss that divides by them gives the same gradient however the
      mini-batch is cut into micro-batches. A plain callable works too (``as_loss_fn``: what
      its optional attributes ``needs_entropy``, ``normaliser`` and ``inert`` say, and nothing else).
    """

    needs: LossNeeds

    def __call__(
        self,
        out: LossOutputs,
        mb: LossInputs,
        num_tokens: float,
        num_seqs: int,
    ) -> tuple["torch.Tensor", dict[str, "float | torch.Tensor"]]: ...

    def inert(self, batch: "Batch") -> list[bool]: ...


@dataclass(frozen=True)
class PlainLoss:
    """A plain loss callable as a ``LossFn``: ``needs`` and ``inert`` as its attributes said."""

    fn: Callable[..., tuple[Any, dict]]
    needs: LossNeeds
    marks: Callable[["Batch"], list[bool]] | None = None  # its own ``inert``, if it has one

    def __call__(self, out, mb, num_tokens, num_seqs):
        return self.fn(out, mb, num_tokens, num_seqs)

    def inert(self, batch: "Batch") -> list[bool]:
        return self.marks(batch) if self.marks is not None else [False] * len(batch)


def as_loss_fn(loss_fn: Any) -> LossFn:
    """``loss_fn`` when it declares ``needs`` (a ``LossNeeds``); else a plain callable as a
    ``PlainLoss``: its ``needs_entropy`` and ``normaliser`` attributes, if set, are its needs and
    its ``inert`` its marks (this is the one place those attributes are read)."""
    if isinstance(getattr(loss_fn, "needs", None), LossNeeds):
        return loss_fn
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as (out, mb, num_tokens, num_seqs) -> (loss, metrics); "
                        f"got a {type(loss_fn).__name__}")
    normaliser = getattr(loss_fn, "normaliser", None)
    needs = LossNeeds(entropy=bool(getattr(loss_fn, "needs_entropy", False)),
                      normaliser=normaliser if normaliser in NORMALISERS else None)
    return PlainLoss(loss_fn, needs, getattr(loss_fn, "inert", None))


def loss_name(loss_fn: LossFn) -> str:
    """The class a loss function was written as (a plain one's, not ``PlainLoss``)."""
    return type(loss_fn.fn if isinstance(loss_fn, PlainLoss) else loss_fn).__name__


@runtime_checkable
class Trainer(Protocol):
    """Policy (plus optional frozen reference and critic) and its optimizer.

    - ``Trainer`` is one trainer (one rank of it). Per-sample results are 1-D
      CPU float32 tensors aligned with ``batch.input_ids[i]`` (same convention
      as ``out.logprobs``) and computed without gradient. ``streams_publish``
      declares that ``train`` takes ``publish`` / ``publish_dtype`` and runs its
      last optimizer step while the weights leave; ``step_ended`` is when the
      last ``train`` call's optimizer work was done (``time.time()``).
    """

    streams_publish: bool
    step_ended: float

    @property
    def step(self) -> int:
        """Number of completed ``train()`` calls (the policy version it has produced)."""
        ...

    def logprobs(self, batch: "Batch") -> list["torch.Tensor"]:
        """Current policy's per-token logprobs, one 1-D tensor per sample."""
        ...

    def ref_logprobs(self, batch: "Batch") -> list["torch.Tensor"]:
        """Frozen reference model's logprobs; raises if no reference is kept."""
        ...

    def values(self, batch: "Batch") -> list["torch.Tensor"]:
        """Critic values (aligned like logprobs); raises if there is no critic."""
        ...

    def train(self, batch: "Batch", loss_fn: LossFn) -> dict[str, float]:
        """Update the weights on ``batch`` with ``loss_fn``; returns metrics."""
        ...

    def accumulate(self, part: "Batch", loss_fn: LossFn, micro_batch_tokens: int | None = None,
                   sms: int | None = None) -> None:
        """Forward and backward of one part of a step's batch; the gradients wait for
        ``train_accumulated`` (one rank; ``trainer/accumulation.py``). ``sms``: on at most that
        many of the GPU's SMs (``trainer/sm_share.py``; None = all)."""
        ...

    def fits(self, tokens: int, length: int) -> bool:
        """Whether one forward and backward of ``tokens`` tokens in rows of ``length`` fits now."""
        ...

    def train_accumulated(self, publish=None, publish_dtype=None) -> dict[str, float]:
        """The optimizer step over the accumulated parts (``publish`` as in ``train``); returns metrics."""
        ...

    def named_weights(self, dtype: "torch.dtype | None" = None) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Policy tensors named as in ``model.state_dict()``, for publishing to engines; ``dtype``
        (the engines', when all agree) lets a trainer hand tensors already in it."""
        ...

    def save(self, path: str | Path, extra: dict[str, Any] | None = None, wait: bool = True) -> None:
        """Write a resumable checkpoint; ``extra`` (JSON) comes back from ``load``. With ``wait=False``
        a trainer may write its files after returning (``trainer.async_checkpoint``): ``wait_saved``
        waits for them."""
        ...

    def wait_saved(self) -> None:
        """Return once every checkpoint ``save`` started is complete on disk."""
        ...

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by ``save``; returns its ``extra``."""
        ...

    def export_hf(self, path: str | Path) -> None:
        """Write the current policy as a plain Hugging Face checkpoint."""
        ...


@runtime_checkable
class TrainerSteps(Protocol):
    """The trainer as the loop holds it: a step's extra passes, its training and its publish."""

    def train_and_publish(self, batch: "Batch", loss_fn: LossFn, version: int) -> "Trained":
        """One ``train`` call whose new weights leave as ``version`` as its optimizer step ends."""
        ...

    def accumulate(self, part: "Batch", loss_fn: LossFn, micro_batch_tokens: int | None = None,
                   sms: int | None = None) -> None:
        """Forward and backward of one part of a step's batch, its gradients kept for
        ``finish_and_publish`` (``trainer/accumulation.py``); ``micro_batch_tokens`` overrides
        the trainer's budget for this part (None: ``trainer.micro_batch_tokens``); ``sms`` confines
        its kernels to that many SMs while engines decode on the same GPU (None: all)."""
        ...

    def finish_and_publish(self, version: int) -> "Trained":
        """The optimizer step over the parts accumulated since the last step, published as ``version``."""
        ...

    def logprobs(self, batch: "Batch") -> list["torch.Tensor"]: ...

    def ref_logprobs(self, batch: "Batch") -> list["torch.Tensor"]: ...

    def values(self, batch: "Batch") -> list["torch.Tensor"]: ...


@runtime_checkable
class TrainerLifecycle(Protocol):
    """The trainer as only ``run/`` holds it, around the loop: start-up checks, resume,
    checkpoints, the final export and the end."""

    def fits(self, tokens: int, length: int) -> bool:
        """Whether a micro-batch of ``tokens`` tokens in rows of ``length`` fits every rank's device
        memory now (one forward and backward, nothing kept; always true on CPU)."""
        ...

    def set_micro_batch_tokens(self, tokens: int) -> None:
        """Every rank's ``trainer.micro_batch_tokens`` from now on (a default that did not fit,
        halved before the first step: ``trainer/fit.py``)."""
        ...

    def describe(self) -> str:
        """One line for the run's log: how many ranks train, and as what kind of trainer."""
        ...

    def stop_if(self, failed: Callable[[], BaseException | None]) -> None:
        """From now on a call in progress stops once ``failed()`` returns an error (another role's,
        e.g. a dead engine whose weight receipt a publish waits for) and raises it: waiting out
        the call's deadline would hide the cause."""
        ...

    def publish(self, version: int) -> float:
        """Publish the current weights as ``version`` (a resume, a warm start); returns host seconds."""
        ...

    def step(self) -> int:
        """Completed ``train`` calls: the policy version the trainer holds."""
        ...

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any]) -> None: ...

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]: ...

    def export_hf(self, path: str | Path) -> None: ...

    def close(self) -> None:
        """Stop the trainer's processes, if it has any."""
        ...


@runtime_checkable
class TrainerHandle(TrainerSteps, TrainerLifecycle, Protocol):
    """The trainer role as a launcher provides it, wherever its ranks run: both surfaces.

    - ``TrainerHandle`` is the trainer role as a launcher provides it, in two surfaces:
      ``TrainerSteps``, what the loop and a step's batch building call, and
      ``TrainerLifecycle``, what only ``run/`` calls around the loop (start-up checks,
      resume, checkpoints, export, close). ``trainer.serve.TrainerHost`` (one process),
      ``launch.roles.TrainerProxy`` (trainer rank processes) and ``launch.ray_roles.RayTrainerProxy``
      provide it; ``tests/unit/launch/test_handles_conform.py`` checks them against both.
    """
