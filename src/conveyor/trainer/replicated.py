"""Data-parallel trainer with the whole model on every rank (``trainer.parallel: replicate``).

- ``ReplicatedTrainer``: a ``LocalTrainer`` on every rank of the default process group, rank 0's
  weights broadcast once at construction. Every public method is COLLECTIVE (the same arguments
  on every rank, the same result on every rank).
- ``train``: each rank runs its share of the mini-batch, then one all-reduce of the gradients
  per flat bucket and the same clipped step everywhere; the update equals the single-device one.
- Contract otherwise as ``trainer/api.py`` and ``trainer/single.py``.

For models that fit on one device: no weight is gathered in forward or
backward (FSDP's per-layer all-gathers), and the only collective of a step is
the gradient sum. FSDP (``fsdp.py``) is for models that do not fit.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conveyor.config import TrainerConfig
from conveyor.trainer.api import LossFn
from conveyor.trainer.microbatch import balance
from conveyor.trainer.ranks import RankGroup
from conveyor.trainer.single import LocalTrainer, NonFiniteLossError
from conveyor.trainer.step_metrics import MetricMean
from conveyor.types import Batch


class ReplicatedTrainer(RankGroup, LocalTrainer):
    """LocalTrainer on every rank of the default process group; gradients summed over the ranks.

    Contract (``trainer/api.py``, ``trainer/single.py``; only differences here)
    - ``ReplicatedTrainer(model_path_or_model, cfg, total_steps, temperature,
      pad_token_id)`` needs ``torch.distributed`` initialised by the caller (the
      default group is the trainer ranks) and the device set. Every rank holds a
      ``LocalTrainer``: the float32 masters, their bf16 compute copy on a GPU, the
      optimizer state, the reference and the critic. Rank 0's weights are
      broadcast once at construction, so every rank starts from the same ones.
    - Every public method is COLLECTIVE: call it on every rank with the same
      arguments (the full Batch); every rank returns the same result.
    - ``train``: a mini-batch's samples are dealt to ranks by tokens; each rank
      runs forward and backward over its share in its own micro-batches, with no
      collective until its share is done (no dummy passes); the gradients are then
      summed over ranks with one all-reduce per flat bucket, and every rank takes
      the same clipped optimizer step (the same gradients and state give the same
      weights). The loss is normalised by the mini-batch's global ``num_tokens`` /
      ``num_seqs``, so the update equals the single-device one. A non-finite loss
      or a failure on any rank raises on every rank before any step.
    - ``logprobs`` / ``ref_logprobs`` / ``values``: each rank computes its share,
      every rank returns all of them.
    - ``save`` / ``export_hf``: rank 0 writes LocalTrainer's checkpoint (a
      filesystem the ranks share); ``load``: every rank reads it.
    - The weights are published after the step (``streams_publish`` is False):
      every rank holds them whole, so publishing gathers nothing.
    """

    streams_publish = False  # every rank steps its own copy, then publishes it whole
    parallel = "replicate"  # what trainer.parallel names it

    def __init__(self, model_path_or_model: Any, cfg: TrainerConfig, total_steps: int,
                 temperature: float = 1.0, pad_token_id: int = 0):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ReplicatedTrainer needs torch.distributed initialised (init_process_group on "
                               "every trainer rank, after torch.cuda.set_device on GPU) before it is constructed")
        super().__init__(model_path_or_model, cfg, total_steps, temperature, pad_token_id)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif "gloo" not in str(dist.get_backend()):
            raise ValueError(f"ReplicatedTrainer on {self.device.type} needs a gloo process group, "
                             f"got {dist.get_backend()!r}")
        with torch.no_grad():  # one starting point: a critic's fresh value head is drawn per process
            for t in self._synced_tensors():
                dist.broadcast(t, src=0)
        self._refresh_compute()

    def _trained(self) -> list[torch.nn.Module]:
        return [self.model] + ([self.critic] if self.critic is not None else [])

    def _synced_tensors(self) -> list[torch.Tensor]:
        return [t for m in self._trained() for t in (*m.parameters(), *m.buffers())]

    def _trained_params(self) -> list[torch.nn.Parameter]:
        return [p for m in self._trained() for p in m.parameters() if p.requires_grad]

    def _share(self, batch: Batch) -> list[int]:
        """This rank's samples of ``batch``: dealt by tokens, the same deal on every rank (a prompt's
        samples together when prompts are shared)."""
        return balance([int(x.numel()) for x in batch.input_ids], self.world, self._prompt_keys(batch))[self.rank]

    # ----------------------------------------------------------------- forward
    def _per_sample(self, batch: Batch, fn) -> list[torch.Tensor]:
        share = self._share(batch)
        mine = self._agree(lambda: super(ReplicatedTrainer, self)._per_sample(batch.select(share), fn)
                           if share else [], "a forward pass")
        return self._gather_samples(list(zip(share, mine)), len(batch))

    # ------------------------------------------------------------------- train
    def _update(self, mini: Batch, loss_fn: LossFn, means: MetricMean, totals: dict, where: str) -> None:
        """One optimizer step on one mini-batch: this rank's share, the gradient sum, the same step everywhere."""
        self._zero_grad()
        share = self._share(mini)
        local, mine = MetricMean(), {"loss": 0.0, "microbatches": 0}
        err: Exception | None = None
        try:
            if share:
                self._backward(mini.select(share), loss_fn, max(float(mini.num_tokens), 1.0), len(mini),
                               self.cfg.micro_batch_tokens, local, mine, where)
        except NonFiniteLossError:
            mine["loss"] = math.nan
        except Exception as e:  # noqa: BLE001 - raised below, after telling the other ranks
            err = e
        rows = self._rows([mine["loss"], float(mine["microbatches"]), float(err is not None)])  # flag last
        self._raise_failures(rows, err, where, "the step")
        totals["loss"] += sum(row[0] for row in rows)
        totals["microbatches"] += int(sum(row[1] for row in rows))
        self._merge_means(means, local)
        params = self._trained_params()
        for p in params:  # a rank without samples (or a parameter its loss did not reach) adds zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._sum([p.grad for p in params])
        self._step_optimizers(totals, where)

    # ----------------------------------------------------- weights and files
    def save(self, path: str | Path, extra: dict[str, Any] | None = None, wait: bool = True) -> None:
        self._agree(lambda: super(ReplicatedTrainer, self).save(path, extra, wait) if self.rank == 0 else None,
                    f"writing checkpoint {path}")

    def load(self, path: str | Path) -> dict[str, Any]:
        # Rank 0 finishes a checkpoint still being written before any rank reads one.
        self._agree(self.wait_saved, "finishing a checkpoint")
        return self._agree(lambda: super(ReplicatedTrainer, self).load(path), f"reading checkpoint {path}")

    def export_hf(self, path: str | Path) -> None:
        self._agree(lambda: super(ReplicatedTrainer, self).export_hf(path) if self.rank == 0 else None,
                    f"exporting {path}")
