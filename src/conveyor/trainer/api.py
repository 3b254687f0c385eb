"""The trainer role's contract: a Batch and a loss function in, new weights out.

Contract
- ``LossFn`` is any callable ``loss_fn(out, mb, num_tokens, num_seqs) ->
  (loss, metrics)``; a metric is a float or a 0-d tensor (tensors are read in one
  transfer per mini-batch, sparing the GPU a wait per micro-batch; they are averaged
  over micro-batches weighted by loss tokens). The trainer calls it once per micro-batch and sums the
  gradients of the returned losses, then takes one optimizer step per
  mini-batch. Because ``num_tokens`` / ``num_seqs`` are totals over the whole
  mini-batch, a loss that divides by them gives the same gradient however the
  mini-batch is cut into micro-batches.

  ``out`` (all ``[b, L]``, aligned with ``mb["input_ids"]``):
    * ``"logprobs"``: ``out["logprobs"][i, t] = log p(x_t | x_<t)``, i.e.
      ``log_softmax(logits[i, t-1] / temperature)[x_t]``; position 0 and
      padding are 0.0. Carries gradient. Positions before the micro-batch's
      first loss token (the prompt every row shares) are 0.0 too: their
      logits are never computed; packed (``trainer.pack_sequences``), every
      position that is not a loss token is 0.0.
    * ``"entropy"``: entropy of the same predictive distribution (the one
      that scored token t), only when ``getattr(loss_fn, "needs_entropy",
      False)`` is true; 0.0 where ``"logprobs"`` is.
    * ``"values"``: critic value for position t, i.e. the critic's output at
      position t-1 (the state before token t was emitted), only when the
      trainer has a critic; 0.0 at position 0 and padding.
  ``mb``: ``"input_ids"`` (long, right-padded), ``"attention_mask"`` (1 on
  real tokens), ``"loss_mask"`` (float) and every ``Batch.fields`` entry
  under its own name, padded with 0, on the trainer's device.

- ``Trainer`` is one trainer (one rank of it). Per-sample results are 1-D
  CPU float32 tensors aligned with ``batch.input_ids[i]`` (same convention
  as ``out["logprobs"]``) and computed without gradient. ``streams_publish``
  declares that ``train`` takes ``publish`` / ``publish_dtype`` and runs its
  last optimizer step while the weights leave; ``step_ended`` is when the
  last ``train`` call's optimizer work was done (``time.time()``).
- ``TrainerHandle`` is what the controller holds: exactly the calls the loop,
  batch building and the launcher make. ``trainer.serve.TrainerHost`` (one
  process) and ``launch.roles.TrainerProxy`` (trainer rank processes)
  provide it; ``tests/unit/launch/test_handles_conform.py`` checks both.

The trainer knows nothing about RL: advantages, clipping, KL and staleness
live in the loss function and the loop. This module holds only protocols.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from conveyor.transport.messages import Trained
    from conveyor.types import Batch


@runtime_checkable
class LossFn(Protocol):
    """``(out, mb, num_tokens, num_seqs) -> (scalar loss, metrics)``.

    Optional attribute ``needs_entropy: bool`` (read with ``getattr``, default
    False) asks the trainer for ``out["entropy"]``; computing it costs one
    more pass over the vocabulary, so it is off unless asked for.
    Optional method ``inert(batch) -> list[bool]`` marks samples whose loss terms
    are zero whatever the policy (a zero advantage everywhere); a trainer may
    leave them out of forward and backward, passing the same ``num_tokens`` /
    ``num_seqs`` (the whole mini-batch's), so the gradient is the same.
    """

    def __call__(
        self,
        out: dict[str, "torch.Tensor"],
        mb: dict[str, "torch.Tensor"],
        num_tokens: float,
        num_seqs: int,
    ) -> tuple["torch.Tensor", dict[str, "float | torch.Tensor"]]: ...


@runtime_checkable
class Trainer(Protocol):
    """Policy (plus optional frozen reference and critic) and its optimizer."""

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
class TrainerHandle(Protocol):
    """The trainer role as the controller calls it, wherever its ranks run."""

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

    def fits(self, tokens: int, length: int) -> bool:
        """Whether a micro-batch of ``tokens`` tokens in rows of ``length`` fits every rank's device
        memory now (one forward and backward, nothing kept; always true on CPU)."""
        ...

    def set_micro_batch_tokens(self, tokens: int) -> None:
        """Every rank's ``trainer.micro_batch_tokens`` from now on (a default that did not fit,
        halved before the first step: ``trainer/fit.py``)."""
        ...

    def finish_and_publish(self, version: int) -> "Trained":
        """The optimizer step over the parts accumulated since the last step, published as ``version``."""
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

    def logprobs(self, batch: "Batch") -> list["torch.Tensor"]: ...

    def ref_logprobs(self, batch: "Batch") -> list["torch.Tensor"]: ...

    def values(self, batch: "Batch") -> list["torch.Tensor"]: ...

    def step(self) -> int:
        """Completed ``train`` calls: the policy version the trainer holds."""
        ...

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any]) -> None: ...

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]: ...

    def export_hf(self, path: str | Path) -> None: ...

    def close(self) -> None:
        """Stop the trainer's processes, if it has any."""
        ...
