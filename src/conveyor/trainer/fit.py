"""Whether the trainer's micro-batches fit the GPU memory they will get, checked before the first step.

- ``check_micro_batches(trainer, cfg, length, memory)`` runs one forward and backward of a
  micro-batch as the steps will: a budget the recipe set that runs out of memory is a
  ``ConfigError`` naming the field and the largest halving that fit; a default budget is halved
  until it fits. Nothing changes in the model; on CPU nothing is checked.
- ``needs_time_share``, ``own_gpu_default`` and ``largest_fitting``: the choices it rests on.
- ``MemoryProbe``: the trainer side, a mixin of ``LocalTrainer``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from conveyor.config.base import ConfigError
from conveyor.trainer.api import LossInputs

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config import RunConfig
    from conveyor.runtime.handles import EngineMemory
    from conveyor.trainer.api import TrainerLifecycle


# A trainer GPU of its own (W1, 0.5B, streaming beside one engine on 2x H200): 32768-token micro-batches
# trained at 52% MFU against 46% for 16384 and gave 300-305 trained samples/s against 289
# (docs/benchmarks.md). Beside an engine the KV pool needs the memory, and on one GPU it made no
# difference (114 against 108-111 samples/s), so 16384 stays the default there.
OWN_GPU_MICRO_BATCH_TOKENS = 32768


def own_gpu_default(cfg: RunConfig, alone: bool) -> int | None:
    """The default micro-batch budget of a trainer whose GPUs no engine uses (``alone``); None: the
    field's default (or the value set) stands.

    ``own_gpu_default(cfg, alone)`` is that starting budget for a trainer whose GPUs hold no
    engine (``alone``: ``Launcher.trainer_gpus_alone()``, launch.placement=disaggregated on GPUs):
    ``OWN_GPU_MICRO_BATCH_TOKENS``, or None (the field's default stands) where the trainer shares
    its GPU, runs on CPU, or the field was set.
    """
    if not alone or "micro_batch_tokens" in cfg.trainer.model_fields_set:
        return None
    return OWN_GPU_MICRO_BATCH_TOKENS


def needs_time_share(trainer: TrainerLifecycle, cfg: RunConfig, length: int) -> bool:
    """``launch.time_share=auto``: release the engines' KV pools only if ``trainer.micro_batch_tokens``
    does not fit beside them (one probe, the pools held). Each switch costs tens of milliseconds a
    step, which a model whose steps take a fraction of a second pays for nothing.

    ``needs_time_share(trainer, cfg, length)`` resolves ``launch.time_share=auto`` on a GPU: the
    pools are released while training only where the micro-batch does not fit beside them.
    """
    return not trainer.fits(cfg.trainer.micro_batch_tokens, length)


def largest_fitting(budget: int, fits: Callable[[int], bool], floor: int = 256) -> int | None:
    """The budget itself if it fits, else the largest of budget / 2, / 4, ... (not below ``floor``)
    that does; None when none does."""
    tokens = budget
    while tokens >= min(floor, budget):
        if fits(tokens):
            return tokens
        tokens //= 2
    return None


def check_micro_batches(trainer: TrainerLifecycle, cfg: RunConfig, length: int,
                        memory: EngineMemory | None, default: int | None = None) -> list[str]:
    """Contract: ``check_micro_batches(trainer, cfg, length, memory)`` runs one forward and backward
    of a micro-batch of ``trainer.micro_batch_tokens`` tokens (rows of ``length`` tokens, the
    longest a sample can be) through ``trainer.fits`` with the colocated engine's KV pool
    released (``memory``, launch.time_share), as the steps will, and, with
    ``loop.accumulate_groups``, one of ``trainer.micro_batch_tokens_shared`` beside the held pool.
    A budget the recipe or the overrides set that runs out of memory is refused with ``ConfigError``:
    one line naming the field, the memory situation, and the largest halving of the budget that did
    fit (or that none did). A budget left at its default is halved until it fits instead (every rank
    told through ``trainer.set_micro_batch_tokens``), and the returned lines say so for the run's log;
    only when no halving fits is it refused too. ``default`` (``own_gpu_default``) replaces the
    field's default as the budget the search starts from.
    Nothing changes in the model: the probe's gradients are dropped. On CPU nothing is checked
    (``fits`` is always true there). ``largest_fitting(budget, fits)`` is the search.
    """
    tc, notes = cfg.trainer, []
    if default is not None and "micro_batch_tokens" not in tc.model_fields_set:
        tc.micro_batch_tokens = default  # still the run's choice, not the user's: halved below if it must be
        tc.model_fields_set.discard("micro_batch_tokens")
        trainer.set_micro_batch_tokens(default)
    probes = []
    if cfg.loop.accumulate_groups and memory is not None:
        probes.append(("trainer.micro_batch_tokens_shared", tc.micro_batch_tokens_shared or tc.micro_batch_tokens,
                       "beside the engine's KV pool"))
    probes.append(("trainer.micro_batch_tokens", tc.micro_batch_tokens,
                   "with the engine's KV pool released" if memory is not None
                   else "on a GPU no engine uses" if default is not None else "beside the engine's KV pool"))
    for field, budget, where in probes:
        released = memory is not None and field == "trainer.micro_batch_tokens"
        if released:
            memory.release()
        try:
            fits = largest_fitting(budget, lambda tokens: trainer.fits(tokens, length))
        finally:
            if released:
                memory.reacquire()
        if fits == budget:
            if field == "trainer.micro_batch_tokens" and default is not None and budget == default:
                notes.append(f"trainer.micro_batch_tokens: {default}, the default for a trainer whose GPUs "
                             "no engine uses")
            continue
        name = field.removeprefix("trainer.")
        if fits is not None and name not in tc.model_fields_set:  # the default, not a choice: halve it
            setattr(tc, name, fits)
            if name == "micro_batch_tokens":
                trainer.set_micro_batch_tokens(fits)
            notes.append(f"{field}: the default {budget} does not fit the trainer's GPU memory {where}; "
                         f"using {fits}, the largest halving that fits")
            continue
        hint = f"set {field}={fits}" if fits else "no smaller budget fit either: lower rollout.kv_fraction"
        raise ConfigError(f"{field}={budget} does not fit the trainer's GPU memory {where} (a micro-batch of "
                          f"{budget} tokens in rows of {length} ran out of memory); {hint}"
                          + ("" if memory is not None or not fits else ", or set launch.time_share=on"))
    return notes


class MemoryProbe:
    """``fits`` for a single-device trainer (``LocalTrainer``). The host class provides ``device``,
    ``model`` (a Hugging Face model: its config gives the vocabulary), ``optimizer`` (and
    ``critic_optimizer``, or None: their state still to come is held during the probe), ``critic``
    and ``_values_out(mb)`` (the value model, or None; the probe runs it as the step does), ``compute`` (the module
    forward and backward run on), ``_policy_out(model, mb, with_entropy, layout=...)`` (a ``LossOutputs``), ``_layout(cpu_mb, loss_only)`` (the packed layout, or None: padded),
    ``_to_device(mb)`` and ``_zero_grad()``. The probe runs the path training runs, packed or padded.

    ``MemoryProbe`` is the trainer side, a mixin of ``LocalTrainer``: ``fits(tokens, length)``
    runs the probe (one forward and backward of random ids) and says whether it ran out of memory.
    """

    def fits(self, tokens: int, length: int) -> bool:
        """Whether one forward and backward of ``tokens`` tokens in rows of ``length`` fits the
        device's memory now; the weights and optimizer are untouched."""
        if self.device.type != "cuda":
            return True  # host memory is not probed: a CPU run swaps before it fails
        held = None
        try:
            # The optimizer state the first step will create is held through the probe: before
            # the first step the memory looks larger than it will be.
            held = torch.empty(self._state_to_come(), dtype=torch.uint8, device=self.device)
            self._probe(tokens, length)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            del held
            torch.cuda.empty_cache()

    def _state_to_come(self) -> int:
        """Bytes of AdamW state (two tensors the size of each trainable parameter, this rank's
        shard of it) that the optimizers have not created yet."""
        total = 0
        for opt in (o for o in (self.optimizer, self.critic_optimizer) if o is not None):
            for p in (p for g in opt.param_groups for p in g["params"] if not opt.state.get(p)):
                local = p.to_local() if hasattr(p, "to_local") else p
                total += 2 * local.numel() * local.element_size()
        return total

    def _probe(self, tokens: int, length: int) -> None:
        """One forward and backward of random ids, ``tokens`` in rows of ``length``; nothing kept."""
        rows, length = max(1, tokens // max(length, 1)), min(length, tokens)
        ids = torch.randint(0, self.model.config.get_text_config(decoder=True).vocab_size, (rows, length))
        cpu_mb = LossInputs(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(rows, length))
        try:
            self.compute.train()
            layout = self._layout(cpu_mb, loss_only=True)
            mb = self._to_device(cpu_mb)
            loss = self._policy_out(self.compute, mb, False, layout=layout).logprobs.sum()
            if self.critic is not None:  # the step's loss holds both graphs until its backward
                loss = loss + self._values_out(mb).sum()
            loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self._zero_grad()
            self.compute.eval()
