"""Data-parallel, fully sharded trainer: LocalTrainer's contract over N ranks with FSDP2.

- ``FSDPTrainer`` shards the decoder layers, the root, the reference and the critic; with bf16
  its numbers are LocalTrainer's. Every public method is COLLECTIVE (the same arguments on every
  rank, the same result on every rank), and the update equals the single-device one.
- ``save`` / ``load``: a sharded checkpoint directory (``checkpoint.py``) on a filesystem the
  ranks share; ``export_hf`` writes plain HF from rank 0.
The class docstring has the details.

It does not start processes, pick ranks or set devices: the launcher does.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from conveyor.config import TrainerConfig
from conveyor.trainer import checkpoint, lora, packing
from conveyor.trainer.api import LossFn, LossInputs, LossOutputs
from conveyor.trainer.microbatch import _check_aligned, balance, collate
from conveyor.trainer.models import (ValueModel, compile_layers, decoder_layers, enable_checkpointing, fuse_layers,
                                     load_policy)
from conveyor.trainer.precision import compute_dtype
from conveyor.trainer.ranks import RankGroup
from conveyor.trainer.single import (LocalTrainer, NonFiniteLossError, head_start, logprob_fn, no_cudnn_attention,
                                     resolve_device)
from conveyor.trainer.step_metrics import MetricMean
from conveyor.types import Batch


def _dim0_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import Shard
    return isinstance(t, DTensor) and t.ndim > 0 and tuple(t.placements) == (Shard(0),)


def _rows(shape: tuple[int, ...], world: int) -> int:
    return -(-shape[0] // world)  # torch.chunk's rows per rank; later ranks may hold fewer or none


def _buckets(tensors: list[torch.Tensor], dtype: torch.dtype, cap_bytes: float, world: int):
    size = torch.empty((), dtype=dtype).element_size()
    bucket, used = [], 0
    for t in tensors:
        n = (_rows(tuple(t.shape), world) * world * math.prod(t.shape[1:]) if t.ndim else 1) * size
        if bucket and used + n > cap_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append(t)
        used += n
    if bucket:
        yield bucket


def _pack(local: list[torch.Tensor], shapes: list[tuple[int, ...]], world: int,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's dim-0 shards, each in its full share of rows, in one flat tensor of ``dtype``:
    one foreach copy (and cast) for the bucket, not a cast and a cat per tensor. The padding
    rows of a shorter share are left unset: unpacking drops them."""
    sizes = [_rows(shape, world) * math.prod(shape[1:]) for shape in shapes]
    flat = torch.empty(sum(sizes), dtype=dtype or local[0].dtype, device=local[0].device)
    dst, src, off = [], [], 0
    for t, n in zip(local, sizes):
        if t.numel():
            dst.append(flat[off:off + t.numel()])
            src.append(t.reshape(-1))
        off += n
    if dst:
        torch._foreach_copy_(dst, src)
    return flat


def _unpack(parts: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """``[world, packed]`` gathered shards -> the full tensors (padding rows dropped), each
    contiguous, made by one foreach copy for the bucket."""
    world, out, dst, src, off = parts.shape[0], [], [], [], 0
    for shape in shapes:
        rows, rest = _rows(shape, world), tuple(shape[1:])
        n = rows * math.prod(rest)
        full = parts.new_empty(world * rows, *rest)
        if n:
            dst.append(full.view(world, n))
            src.append(parts[:, off:off + n])
        out.append(full[:shape[0]])
        off += n
    if dst:
        torch._foreach_copy_(dst, src)
    return out


def _kinds(params) -> tuple[list, list]:
    """Sharded (DTensor) and whole (replicated norm) parameters: foreach and fused kernels
    (AdamW, norms, clipping) take one kind per call."""
    params = list(params)
    return [p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")


def _shard(module: nn.Module, mesh, dtype: torch.dtype, device: torch.device, keep: bool = False) -> nn.Module:
    """Shard ``module`` (float32 masters). With a low-precision ``dtype`` the decoder layers'
    linear weights and biases are gathered in it, the embeddings and head in float32, and the
    layers' norm weights are not sharded at all (float32, whole on every rank, gradients
    summed by ``_sum_replicated``), for forward under autocast: the numbers of float32
    weights under autocast, as the single-device trainer computes (everything in bf16
    learned less). ``keep``: the layers stay gathered after their forward (``fsdp_reshard=step``)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    exact = MixedPrecisionPolicy()
    low = exact if dtype == torch.float32 else \
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    # One FSDP unit per decoder layer bounds the gathered weights to a layer
    # at a time; a model without _no_split_modules is sharded as one unit.
    replicated: set[nn.Parameter] = set()
    for layer in decoder_layers(module):
        norms: set[nn.Parameter] = set()
        if low is not exact:
            # A few KB each: as FSDP units of their own (one dtype per unit) they would cost an
            # all-gather, a reduce-scatter and four hooks per micro-batch each.
            norms = {p for m in layer.modules() if _is_norm(m) for p in m.parameters(recurse=False)}
        fully_shard(layer, mesh=mesh, mp_policy=low, ignored_params=norms or None, reshard_after_forward=not keep)
        replicated |= norms
    fully_shard(module, mesh=mesh, mp_policy=exact, ignored_params=replicated or None)
    for p in replicated:  # FSDP moves only what it manages
        p.data = p.data.to(device)
    if keep:  # gathered until _release, after the step's last backward
        module.set_reshard_after_backward(False)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            # The loss is already normalised by GLOBAL totals, so rank gradients
            # must be summed, not averaged. Plain SUM (no pre/post scaling op)
            # also works on gloo, which lacks AVG and PREMUL_SUM.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return module


class FSDPTrainer(RankGroup, LocalTrainer):
    """Policy (+ optional reference and critic) sharded over the default process group.

    Contract (``trainer/api.py``, ``trainer/single.py``; only differences here)
    - ``FSDPTrainer(model_path_or_model, cfg, total_steps, temperature,
      pad_token_id)`` needs ``torch.distributed`` initialised by the caller (the
      default group is the trainer ranks) and the device set. Decoder layers, the
      root, the reference and the critic are ``fully_shard``-ed; with bf16 the
      layers' linear weights are gathered in bf16, embeddings and head in fp32,
      norm weights kept whole on every rank, gradients reduced in fp32:
      LocalTrainer's numbers (on CPU everything is fp32).
    - Every public method is COLLECTIVE: call it on every rank with the same
      arguments (the full Batch); every rank returns the same result.
    - ``train``: samples dealt to ranks by tokens, dummy passes so every rank runs
      as many forwards; gradients summed over ranks with the mini-batch's global
      ``num_tokens`` / ``num_seqs``, so the update equals the single-device one. A
      non-finite loss on any rank raises on every rank before backward.
    - ``save`` / ``load``: a sharded checkpoint directory (``checkpoint.py``) on a
      filesystem the ranks share; ``export_hf`` writes plain HF from rank 0.
    - Device: CUDA's current device (the caller ran ``torch.cuda.set_device``), or "cpu" (gloo)
      when ``cfg.device`` resolves to cpu. Every decoder layer (``_no_split_modules``), then the
      root, is ``fully_shard``-ed. With ``cfg.param_dtype`` float32 everything is gathered in
      fp32 (under autocast on CUDA). A layer's weights are gathered per micro-batch or, with
      ``trainer.fsdp_reshard=step``, once per step (freed after the step's last backward and
      after forward-only passes, so no layer computes with weights older than the step).
    - ``train``: a mini-batch's samples go longest first onto the least-loaded rank (with
      ``pack_sequences: shared`` a prompt's samples go to one rank together); ranks with fewer
      micro-batches run zero-weighted dummy passes; gradients are summed, not averaged, with
      one reduce-scatter per optimizer step. Metrics are reduced over ranks: ``microbatches``
      counts real ones on all ranks, ``time_s`` is the slowest rank's. A non-finite loss or a
      ``loss_fn`` error on ANY rank (an all-reduced flag) raises on every rank before backward,
      and that mini-batch takes no step.
    - ``logprobs`` / ``ref_logprobs`` / ``values``: token-balanced shares, gathered back into
      the batch's order on every rank. ``named_weights(dtype=None)`` is a collective generator
      of full tensors on the trainer's device: iterate it to the end on every rank.
    - ``save`` writes ``dcp/`` (model + optimizer, critic + its optimizer, by
      torch.distributed.checkpoint), ``training_state.pt`` (schedulers, step),
      ``rng/rank{r}.pt``, ``extra.json``, ``policy/`` (config + tokenizer) and the
      ``fsdp.json`` marker; rank 0 renames it into place atomically.
    """

    streams_publish = False  # its publish is a collective gather after the step
    parallel = "fsdp"  # what trainer.parallel names it

    def __init__(self, model_path_or_model: Any, cfg: TrainerConfig, total_steps: int,
                 temperature: float = 1.0, pad_token_id: int = 0):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("FSDPTrainer needs torch.distributed initialised (init_process_group on every "
                               "trainer rank, after torch.cuda.set_device on GPU) before it is constructed")
        if temperature <= 0:
            raise ValueError(f"FSDPTrainer: temperature must be > 0 (got {temperature})")
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg, self.total_steps = cfg, int(total_steps)
        self.temperature, self.pad_token_id = float(temperature), int(pad_token_id)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        dev = resolve_device(cfg.device)
        self.device = torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev
        no_cudnn_attention(self.device)
        if self.device.type == "cpu" and "gloo" not in str(dist.get_backend()):
            raise ValueError(f"FSDPTrainer on cpu needs a gloo process group, got {dist.get_backend()!r}")
        model, self.source_dir = load_policy(model_path_or_model)
        # save_pretrained would record the class name; FSDP renames the class
        # (FSDPLlamaForCausalLM), so fix the architecture name before sharding.
        model.config.architectures = [type(model).__name__]
        # Copies are taken before training or sharding touches the weights.
        reference = copy.deepcopy(model).requires_grad_(False) if cfg.reference else None
        critic = ValueModel(copy.deepcopy(model.base_model), model.config.hidden_size) if cfg.critic else None
        if cfg.lora.enabled:  # after the copies: the reference and the critic stay plain
            model = lora.attach(model, cfg.lora)
        if cfg.gradient_checkpointing:
            enable_checkpointing(model)
            if critic is not None:
                enable_checkpointing(critic.backbone)
        self._packed = packing.enable(cfg, self.device, [model, reference])
        fuse_layers(cfg, model, self.device)
        if cfg.compile:  # before sharding, as FSDP2 expects
            compile_layers(model)
        self._token_logprobs = logprob_fn(cfg)
        mesh = init_device_mesh(self.device.type, (self.world,))
        self._dtype = compute_dtype(cfg, self.device)
        self._keep = cfg.fsdp_reshard == "step"
        self.model = _shard(model, mesh, self._dtype, self.device, self._keep).eval()
        self.compute, self._copies = self.model, []  # sharded float32 masters, cast by the policy
        self.reference = _shard(reference, mesh, self._dtype, self.device).eval() if reference is not None else None
        self.critic = _shard(critic, mesh, self._dtype, self.device, self._keep) if critic is not None else None
        self.optimizer, self.scheduler = self._optimizer(self.model.parameters(), cfg.lr)
        self.critic_optimizer = self.critic_scheduler = None
        if self.critic is not None:
            self.critic_optimizer, self.critic_scheduler = self._optimizer(self.critic.parameters(), cfg.critic_lr)
        self._step = 0

    def _param_groups(self, params) -> list[dict]:
        return [{"params": g} for g in _kinds(p for p in params if p.requires_grad) if g]

    def _sum_replicated(self) -> None:
        """Sum the gradients of the replicated (norm) weights over ranks, as FSDP's
        reduce-scatter sums the sharded ones. Every rank holds the same list: every
        parameter is in every rank's graph (``_pass``'s anchor)."""
        grads = [p.grad for m in self._trained() for p in _kinds(m.parameters())[1] if p.grad is not None]
        if grads:
            self._sum(grads)

    def _plans(self, batch: Batch) -> list[list[list[int]]]:
        """Per rank, its micro-batches as lists of sample indices (packed unless the batch replays routes)."""
        lengths, packs, keys = [int(x.numel()) for x in batch.input_ids], self._packs(batch), self._prompt_keys(batch)
        return [[[share[k] for k in mb]
                 for mb in packing.micro_batches(self.cfg, [lengths[i] for i in share], packs, None,
                                                 [keys[i] for i in share] if keys else None)]
                for share in balance(lengths, self.world, keys)]

    def _dummy(self) -> LossInputs:
        # A real 2-token forward (attention_mask 1: a fully masked row can give
        # NaN in attention, and NaN * 0 is still NaN).
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long)
        return self._to_device(LossInputs(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          loss_mask=torch.zeros(1, 2)))

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def _per_sample(self, batch: Batch, fn) -> list[torch.Tensor]:
        _check_aligned(batch, list(range(len(batch))))  # on every rank: collate would fail on one rank only
        lengths = [int(x.numel()) for x in batch.input_ids]
        plans = self._plans(batch)
        mine, passes = plans[self.rank], max(map(len, plans), default=0)
        local = []
        for j in range(passes):
            if j >= len(mine):
                fn(self._dummy(), None)  # FSDP forwards are collective: match the busiest rank
                continue
            mb = collate(batch, mine[j], self.pad_token_id, self.cfg.pad_multiple)
            values = fn(self._to_device(mb), self._layout(mb, loss_only=False)).float().cpu()
            local += [(i, values[row, : lengths[i]].clone()) for row, i in enumerate(mine[j])]
        self._release()
        return self._gather_samples(local, len(batch))

    # ------------------------------------------------------------------- train
    def _trained(self) -> list[nn.Module]:
        return [self.model] + ([self.critic] if self.critic is not None else [])

    def _pass(self, mb: LossInputs, with_entropy: bool, start: int,
              layout: packing.Layout | None = None) -> tuple[LossOutputs, torch.Tensor]:
        """Forward both trained models; returns ``out`` and a zero-weighted anchor loss.

        The anchor puts every parameter of both models into every rank's graph
        whatever loss_fn uses, so FSDP reduce-scatters the same parameters
        on every rank (a mismatch would hang or misalign the collective).
        """
        out = self._policy_out(self.model, mb, with_entropy, start, layout)
        anchor = 0.0 * out.logprobs.sum()
        if self.critic is not None:
            out = dataclasses.replace(out, values=self._values_out(mb))
            anchor = anchor + 0.0 * out.values.sum()
        return out, anchor

    def _drain(self) -> None:
        # After a failure mid-mini-batch, gradients of earlier no-sync passes sit
        # in FSDP's unsharded buffers, which zero_grad does not clear; one
        # zero-weighted synced pass flushes them into .grad (zeroed afterwards).
        for m in self._trained():
            m.set_requires_gradient_sync(True)
        self._pass(self._dummy(), False, 0)[1].backward()
        self._release()

    def _release(self) -> None:
        """``fsdp_reshard=step``: free every gathered weight (FSDP re-gathers only what it freed:
        a layer still gathered after an optimizer step would run on stale weights)."""
        if not self._keep:
            return
        from torch.distributed.fsdp import FSDPModule
        for model in self._trained():
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def _update(self, mini: Batch, loss_fn: LossFn, means: MetricMean, totals: dict, where: str) -> None:
        """One optimizer step on one mini-batch, its micro-batches spread over the ranks."""
        self._zero_grad()
        num_tokens = max(float(mini.num_tokens), 1.0)
        needs_entropy = loss_fn.needs.entropy
        _check_aligned(mini, list(range(len(mini))))  # on every rank: collate would fail on one rank only
        plans = self._plans(mini)
        mine, passes = plans[self.rank], max(map(len, plans))
        local = MetricMean()
        for j in range(passes):
            for m in self._trained():
                # Reduce-scatter once, after the last backward. Until then each rank
                # holds UNSHARDED gradients (full model size, fp32): comms traded for memory.
                m.set_requires_gradient_sync(j == passes - 1)
            real = j < len(mine)
            cpu_mb = collate(mini, mine[j], self.pad_token_id, self.cfg.pad_multiple) if real else None
            mb = self._to_device(cpu_mb) if real else self._dummy()
            out, loss = self._pass(mb, needs_entropy and real, head_start(cpu_mb) if real else 0,
                                   self._layout(cpu_mb, True) if real else None)
            value, err, metrics, loss_j = 0.0, None, {}, None
            if real:
                try:
                    loss_j, metrics = loss_fn(out, mb, num_tokens, len(mini))
                    value = self._check_loss(loss_j, f"{where}, micro-batch {j}")
                    loss = loss + loss_j
                except NonFiniteLossError:
                    value = float(loss_j.detach()) if isinstance(loss_j, torch.Tensor) else math.nan
                except Exception as e:  # noqa: BLE001 - raised below, after telling the other ranks
                    err = e
            rows = self._rows([value, float(err is not None)])
            self._raise_failures(rows, err, f"{where}, micro-batch {j}", "loss_fn", cleanup=self._drain)
            loss.backward()
            totals["loss"] += sum(v for v, _ in rows)
            if real:
                local.add(metrics, float(mb.loss_mask.sum()))
        totals["microbatches"] += sum(map(len, plans))
        self._release()
        self._merge_means(means, local)
        self._sum_replicated()
        self._step_optimizers(totals, where)

    def _clip(self, params, where: str) -> float:
        params = [p for p in params if p.grad is not None]
        if not params:
            return 0.0
        kinds = [kind for kind in _kinds(params) if kind]
        squares = []
        for kind in kinds:
            part = torch.nn.utils.get_total_norm([p.grad for p in kind])
            # Each rank holds a partial norm of its shards; full_tensor() all-reduces it.
            # The replicated gradients are whole and equal on every rank: counted once.
            squares.append((part.full_tensor() if isinstance(part, DTensor) else part).float() ** 2)
        total = torch.stack(squares).sum().sqrt()
        norm = float(total)
        if not math.isfinite(norm):
            raise NonFiniteLossError(
                f"trainer step {self._step}, {where}: gradient norm is {norm}; no optimizer step was taken "
                "(the loss is finite but its gradient is not; check for log(0) or division by ~0 in the loss)")
        if self.cfg.max_grad_norm is not None:
            for kind in kinds:
                torch.nn.utils.clip_grads_with_norm_(kind, self.cfg.max_grad_norm, total)
        return norm

    # ----------------------------------------------------- weights and files
    def named_weights(self, dtype: torch.dtype | None = None,
                      bucket_mb: float = 256.0) -> Iterator[tuple[str, torch.Tensor]]:
        """``_full_weights``; with ``trainer.lora`` the merged weights (from float32 gathers) or
        only the adapters, gathered alone (``lora.published``). COLLECTIVE."""
        lo = self.cfg.lora
        if lo.enabled:
            only = lora.is_adapter if lo.publish == "adapter" else None
            return lora.published(self._full_weights(None, bucket_mb, only), lo)
        return self._full_weights(dtype, bucket_mb)

    def _full_weights(self, dtype: torch.dtype | None = None, bucket_mb: float = 256.0,
                      select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full policy tensors (float32, or ``dtype``) named as in ``state_dict()``; COLLECTIVE.

        Shards are cast before gathering (bf16 halves the bytes) and gathered ``bucket_mb``
        MiB of shards at a time in one all-gather (not one collective per tensor, each with its
        own launch and latency). A tensor tied to an earlier one (output = input
        embedding) is gathered once and yielded under both names. ``select``: only these names."""
        dtype = dtype or torch.float32
        items = [(n, t) for n, t in self.model.state_dict(keep_vars=True).items() if select is None or select(n)]
        unique = list({id(t): t for _, t in items}.values())
        last = {id(t): i for i, (_, t) in enumerate(items)}  # where each tensor's last name is
        full: dict[int, torch.Tensor] = {}
        emitted = 0
        for bucket in _buckets(unique, dtype, bucket_mb * 2**20, self.world):
            full.update(zip(map(id, bucket), self._gather(bucket, dtype)))
            # Yield every name whose tensor is ready, in state_dict order.
            while emitted < len(items) and id(items[emitted][1]) in full:
                name, t = items[emitted]
                yield name, full[id(t)]
                emitted += 1
            for t in bucket:  # keep only what a later (tied) name still needs
                if last[id(t)] < emitted:
                    full.pop(id(t), None)

    def _gather(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Full copies of ``tensors`` (dim-0 sharded DTensors or plain tensors) in ``dtype``."""
        sharded = [t for t in tensors if _dim0_sharded(t)]
        out = {id(t): t.detach().to(dtype) for t in tensors if not isinstance(t, DTensor)}
        for t in tensors:
            if isinstance(t, DTensor) and not _dim0_sharded(t):
                out[id(t)] = t.detach().to(dtype).full_tensor()
        if sharded:
            shapes = [tuple(t.shape) for t in sharded]
            mine = _pack([t.to_local().detach() for t in sharded], shapes, self.world, dtype)
            parts = torch.empty(self.world, mine.numel(), dtype=dtype, device=mine.device)
            if self.device.type == "cuda":
                dist.all_gather_into_tensor(parts, mine)
            else:  # gloo has only the list form
                dist.all_gather(list(parts.unbind(0)), mine)
            out.update(zip(map(id, sharded), _unpack(parts, shapes)))
        return [out[id(t)] for t in tensors]

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim}
        if self.critic is not None:
            state["critic"], state["critic_optim"] = get_state_dict(self.critic, self.critic_optimizer)
        return state

    def _forget_optimizer_state(self) -> None:
        # get_state_dict fills an empty AdamW state with a fake step (lr 0,
        # step count 1), which would change the next real update's bias correction.
        for opt in (self.optimizer, self.critic_optimizer):
            if opt is not None:
                opt.state.clear()

    def _write_config(self, out: Path) -> None:
        self.model.config.save_pretrained(out)
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.save_pretrained(out)
        checkpoint.copy_tokenizer_files(self.source_dir, out)

    def _write_shards(self, tmp: Path, extra_text: str, fresh: bool) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(), checkpoint_id=str(tmp / "dcp"))
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(checkpoint._rng_state(), tmp / "rng" / f"rank{self.rank}.pt")
        if self.rank != 0:
            return
        (tmp / "policy").mkdir()
        self._write_config(tmp / "policy")
        state = {"step": self._step, "scheduler": self.scheduler.state_dict(), "optimizer_fresh": fresh}
        if self.critic_scheduler is not None:
            state["critic_scheduler"] = self.critic_scheduler.state_dict()
        torch.save(state, tmp / "training_state.pt")
        (tmp / "extra.json").write_text(extra_text)
        marker = {"format": "torch.distributed.checkpoint", "world_size": self.world,
                  "critic": self.critic is not None}
        (tmp / checkpoint.SHARDED_MARKER).write_text(json.dumps(marker, indent=2))

    def wait_saved(self) -> None:
        """Sharded checkpoints are complete when ``save`` returns."""

    def save(self, path: str | Path, extra: dict[str, Any] | None = None, wait: bool = True) -> None:
        try:
            text = json.dumps(extra or {}, indent=2, sort_keys=True)
        except TypeError as e:
            raise TypeError(f"checkpoint extra must be JSON-serialisable ({e}); pass plain numbers/strings/lists") from None
        fresh = not self.optimizer.state
        tmp = self._agree(lambda: checkpoint._prepare_tmp(path) if self.rank == 0 else None, f"creating {path}")
        tmp = Path(self._broadcast(str(tmp)))
        try:
            self._agree(lambda: self._write_shards(tmp, text, fresh), f"writing checkpoint {path}")
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if fresh:
                self._forget_optimizer_state()
        self._agree(lambda: checkpoint._commit(tmp, path) if self.rank == 0 else None, f"renaming into {path}")

    def _read_marker(self, path: Path) -> None:
        marker = path / checkpoint.SHARDED_MARKER
        if not marker.is_file():
            raise FileNotFoundError(f"{path} is not a sharded conveyor checkpoint (no {marker.name}); "
                                    "pass a directory written by FSDPTrainer.save")
        has_critic = bool(json.loads(marker.read_text())["critic"])
        if has_critic != (self.critic is not None):
            raise ValueError(
                f"checkpoint {'has' if has_critic else 'has no'} critic but this trainer "
                f"{'has none' if has_critic else 'has one'}; set trainer.critic={str(has_critic).lower()}")

    def load(self, path: str | Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(path)
        self._agree(lambda: self._read_marker(path), f"reading {path}")
        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.critic is not None:
            set_state_dict(self.critic, self.critic_optimizer, model_state_dict=state["critic"],
                           optim_state_dict=state["critic_optim"])
        training = torch.load(path / "training_state.pt", weights_only=True)
        self.scheduler.load_state_dict(training["scheduler"])
        if self.critic_scheduler is not None:
            self.critic_scheduler.load_state_dict(training["critic_scheduler"])
        self._step = int(training["step"])
        if training["optimizer_fresh"]:
            self._forget_optimizer_state()
        rng = path / "rng" / f"rank{self.rank}.pt"
        # Resuming on more ranks than saved: the extra ranks start from rank 0's RNG.
        checkpoint._set_rng_state(torch.load(rng if rng.is_file() else path / "rng" / "rank0.pt",
                                             weights_only=True))
        return json.loads((path / "extra.json").read_text())

    def export_hf(self, path: str | Path) -> None:
        state = {}
        for name, t in self._full_weights() if self.cfg.lora.enabled else self.named_weights():
            if self.rank == 0:
                state[name] = t.cpu()

        def write() -> None:
            if self.rank == 0:
                with checkpoint._atomic_dir(path) as tmp:
                    self._write_config(tmp)
                    if self.cfg.lora.enabled:  # merged, the adapter in path/adapter
                        lora.write_export(state, self.cfg.lora, tmp, "merged")
                    else:
                        checkpoint.save_hf_weights(state, tmp)

        self._agree(write, f"exporting {path}")
