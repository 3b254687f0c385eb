"""Single-device trainer: a Hugging Face causal LM, AdamW, and a token budget.

Contract (``trainer/api.py`` for the loss function and output alignment):
``LocalTrainer(model_path_or_model, cfg, total_steps, temperature,
pad_token_id)`` holds float32 master weights on one device; on CUDA forward and
backward run under bf16 autocast on bf16 copies of the linear weights
(``precision.py``), on CPU nothing is cast (exact, deterministic).
``train(batch, loss_fn)``: ``cfg.ppo_epochs`` passes over ``cfg.mini_batches``
chunks, one optimizer step per chunk over token-budget micro-batches; the LR
schedule counts ``train`` calls. A non-finite loss or gradient norm raises
``NonFiniteLossError`` naming where, and that mini-batch takes no step. Routing
replay, the optional reference and critic, the streamed publish
(``streamed.py``), accumulation (``accumulation.py``) and the memory probe
(``fit.py``): the class docstring. Loading is ``models.py``'s.

It does not know what the loss computes, where the batch came from, or how
weights reach engines (``named_weights`` just yields the live tensors).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor import routing
from conveyor.config import TrainerConfig
from conveyor.runtime.errors import NonFiniteLossError
from conveyor.trainer import checkpoint, lora, packing
from conveyor.trainer.accumulation import AccumulatingTrainer, Accumulation
from conveyor.trainer.api import LossFn, LossInputs, LossOutputs, as_loss_fn, loss_name
from conveyor.trainer.fit import MemoryProbe
from conveyor.trainer.logprobs import target_logprobs, token_logprobs
from conveyor.trainer.microbatch import collate, live_samples, split_even
from conveyor.trainer.models import (
    ValueModel,
    compile_layers,
    enable_checkpointing,
    fuse_layers,
    load_policy,
)
from conveyor.trainer.precision import compute_dtype, linear_copy
from conveyor.trainer.step_metrics import MetricMean, to_host
from conveyor.trainer.streamed import StreamPlan
from conveyor.transport.weights import copy_pairs
from conveyor.types import Batch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"trainer.device={name!r} but CUDA is not available; set trainer.device=cpu or auto")
    return dev


def no_cudnn_attention(device: torch.device) -> None:
    """cuDNN's attention builds a graph for every new ``[batch, length]`` (milliseconds of host
    time per call) and an RL step brings new shapes every time;
    flash attention has no per-shape setup. Process-wide rather than a context, so that the
    recompute of checkpointed layers during backward picks the same kernel."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def lr_multiplier(step: int, warmup: int, total: int, schedule: str) -> float:
    """LR factor for ``train()`` call ``step`` (0-based).

    warmup (step < warmup): (step + 1) / warmup, so the first call already
    learns and call ``warmup - 1`` runs at the full LR.
    afterwards, with p = (step - warmup) / max(1, total - warmup) clipped to [0, 1]:
    constant 1; linear 1 - p; cosine 0.5 * (1 + cos(pi * p)). Both decays reach
    0 at step == total.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown trainer.lr_schedule {schedule!r}; use constant, linear or cosine")


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    # Counting real tokens gives arange for right padding (and would also be
    # right for left padding); padding positions get 0, they are masked anyway.
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def model_inputs(mb: LossInputs, with_mask: bool) -> dict[str, torch.Tensor | None]:
    """Keyword inputs of a forward over a right-padded micro-batch.

    Without the mask, real tokens see only earlier real tokens anyway (causal
    attention, padding on the right), so their outputs are unchanged and
    attention may use its fused causal kernel. Positions are then a plain
    arange on every row: positions that restart at 0 would read as packed
    sequences and bring a block mask back.
    """
    ids, am = mb.input_ids, mb.attention_mask
    if with_mask:
        return {"input_ids": ids, "attention_mask": am, "position_ids": position_ids(am)}
    pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    return {"input_ids": ids, "attention_mask": None, "position_ids": pos}


def shift_right(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, L] -> [b, L] with out[:, t] = x[:, t-1], 0 at position 0 and padding."""
    return F.pad(x[:, :-1], (1, 0)) * attention_mask.to(x.dtype)


def head_start(mb: LossInputs) -> int:
    """The first position whose logits a loss can use. Position t is scored by the logits at
    t - 1, so positions before the micro-batch's first loss token minus one (the prompt part
    every row shares) need no vocabulary head: with 152k-word vocabularies that head is a
    large share of a small model's step. 0 when every token is masked."""
    cols = mb.loss_mask.any(0).nonzero()
    return max(0, int(cols[0]) - 1) if cols.numel() else 0


@functools.cache
def _keeps_logits(cls: type) -> bool:
    import inspect
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def logprob_fn(cfg: TrainerConfig):
    if cfg.compile:  # the compiler fuses the plain form; the chunked loop would only get in its way
        return torch.compile(functools.partial(token_logprobs, chunk_rows=None), dynamic=True)
    return functools.partial(token_logprobs, chunk_rows=cfg.logprob_chunk_rows,
                             kernel=None if cfg.kernels else False)


@contextlib.contextmanager
def profiled(cfg: TrainerConfig, step: int, rank: int, device: torch.device):
    """Record this train() call with torch.profiler when ``step`` is in ``cfg.profile_steps``:
    ``trainer-step<step>-rank<rank>.json`` (a trace) and ``.txt`` (top operators) in ``cfg.profile_dir``."""
    if step not in cfg.profile_steps:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    out = Path(cfg.profile_dir or "profile")
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)  # the step's kernels belong in its trace
    stem = out / f"trainer-step{step}-rank{rank}"
    prof.export_chrome_trace(str(stem.with_suffix(".json")))
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40)
    stem.with_suffix(".txt").write_text(table + "\n")


class LocalTrainer(AccumulatingTrainer, MemoryProbe):
    """Policy (+ optional reference and critic) on one device; implements ``Trainer``.

    ``model`` is the float32 masters (what the optimizer steps, checkpoints save, ``named_weights``
    publishes); ``compute`` runs forward and backward: with ``param_dtype`` bfloat16 bf16 copies of
    the linear weights (gradients summed into the masters' in float32, refreshed after every step)
    sharing every other tensor with ``model``. ``train`` cuts the batch into the same
    ``mini_batches`` chunks each pass (sizes differing by at most one); per chunk: zero grad, one
    backward per micro-batch (``plan_microbatches``, or ``packing.micro_batches`` / ``plan_shared``
    with a host-built ``packing.Layout``), clip, step; an all-masked chunk gives 0, not 0/0. The
    scheduler steps once per call, so ``warmup_steps`` and ``total_steps`` (authoritative, resolved
    by the caller) are loop steps (``lr_multiplier``); earlier mini-batches of a failing call have
    stepped. The reference is a deep copy at construction; the critic a backbone copy plus
    ``Linear(hidden, 1)`` with its own AdamW (``critic_lr``); with ``routes`` the critic routes on
    its own. ``accumulate(..., sms=n)`` may run in a green context of n SMs (``sm_share.py``).
    ``ReplicatedTrainer`` is this class on every rank, gradients summed over ranks.
    """

    streams_publish = True  # train(publish=...) steps the optimizer as the weights leave
    _publish = _stepped = _publish_error = None  # that train call's publisher, plan, failure
    step_ended = 0.0  # time.time() when the last train call's optimizer work was done

    def __init__(self, model_path_or_model: Any, cfg: TrainerConfig, total_steps: int,
                 temperature: float = 1.0, pad_token_id: int = 0):
        if temperature <= 0:
            raise ValueError(f"LocalTrainer: temperature must be > 0 (got {temperature}); "
                             "logprobs of greedy sampling are not defined")
        self.cfg = cfg
        self.total_steps = int(total_steps)
        self.temperature = float(temperature)
        self.pad_token_id = int(pad_token_id)
        self.device = resolve_device(cfg.device)
        no_cudnn_attention(self.device)
        self.model, self.source_dir = load_policy(model_path_or_model)
        # Copies are taken before training ever touches the weights.
        self.reference = copy.deepcopy(self.model) if cfg.reference else None
        self.critic = None
        if cfg.critic:
            backbone = copy.deepcopy(self.model.base_model)
            self.critic = ValueModel(backbone, self.model.config.hidden_size).to(self.device)
        if cfg.lora.enabled:  # after the copies: the reference and the critic stay plain
            self.model = lora.attach(self.model, cfg.lora)
            self.streams_publish = False  # a merge needs a layer's stepped adapters: publish after the step
        self.model.to(self.device)
        self._dtype = compute_dtype(cfg, self.device)
        # self.model holds the float32 master weights (optimizer, checkpoints, publishing);
        # self.compute is what forward and backward run on: the same module, or one whose
        # linear weights are bf16 copies feeding their gradients to the masters'.
        self.compute, self._copies = self.model, []
        self._publish_list: list | None = None  # named_weights(bf16), listed on first use
        self._plans: dict = {}  # publish dtype -> StreamPlan
        self._acc: Accumulation | None = None  # a step's parts accumulated so far (``accumulate``)
        self._sm_share = None  # green contexts of parts trained beside the engine (``accumulate(sms=)``)
        if self.reference is not None:
            self.reference.to(self.device).eval().requires_grad_(False)
        if self._dtype != torch.float32:
            self.compute, self._copies = linear_copy(self.model, self._dtype)
            if self.reference is not None:  # frozen: its float32 linear weights are not kept
                self.reference = linear_copy(self.reference, self._dtype)[0]
        if cfg.gradient_checkpointing:
            enable_checkpointing(self.compute)
            if self.critic is not None:
                enable_checkpointing(self.critic.backbone)
        self._packed = packing.enable(cfg, self.device, [self.model, self.compute, self.reference])
        fuse_layers(cfg, self.compute, self.device)
        if cfg.compile:
            compile_layers(self.compute)
        self._token_logprobs = logprob_fn(cfg)
        self.model.eval()
        self.compute.eval()
        self.optimizer, self.scheduler = self._optimizer(self.model.parameters(), cfg.lr)
        self.critic_optimizer = self.critic_scheduler = None
        if self.critic is not None:
            self.critic_optimizer, self.critic_scheduler = self._optimizer(self.critic.parameters(), cfg.critic_lr)
        self._step = 0
        self._saving: checkpoint.PendingSave | None = None  # a checkpoint still being written

    def _param_groups(self, params) -> list[dict]:
        return [{"params": [p for p in params if p.requires_grad]}]

    def _optimizer(self, params, lr: float):
        groups = self._param_groups(params)
        params = [p for g in groups for p in g["params"]]
        # On a GPU one fused kernel updates every tensor; the default launches several per tensor.
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(self.cfg.betas),
                                weight_decay=self.cfg.weight_decay, fused=fused or None)
        cfg, total = self.cfg, self.total_steps
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_multiplier(s, cfg.warmup_steps, total, cfg.lr_schedule))
        return opt, sched

    @property
    def step(self) -> int:
        return self._step

    # ----------------------------------------------------------------- forward
    def _autocast(self):
        # Low-precision linear weights (the copies here, the gathered ones under FSDP) meet
        # float32 activations under autocast, on any device; float32 weights get bf16 autocast
        # on a GPU.
        if self._dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self._dtype)
        if self.device.type == "cuda" and self.cfg.autocast_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _refresh_compute(self) -> None:
        """Copy the master weights into the compute copy (after a step or a load)."""
        copy_pairs(self._copies)

    def _to_device(self, mb: LossInputs) -> LossInputs:
        return mb.to(self.device)

    @property
    def _shared(self) -> bool:
        """Whether packed micro-batches compute each group's prompt once (``pack_sequences: shared``)."""
        return self._packed and self.cfg.pack_sequences == "shared"

    def _packs(self, batch: Batch) -> bool:
        """Whether ``batch`` trains packed: packing is on and it replays no MoE routes (padded)."""
        return self._packed and batch.routes is None

    def _layout(self, cpu_mb: LossInputs, loss_only: bool) -> packing.Layout | None:
        """The packed layout of a host micro-batch (its loss tokens, or every token), or None: padded."""
        if not self._packed or cpu_mb.routes is not None:
            return None
        am = cpu_mb.attention_mask
        need = cpu_mb.loss_mask > 0 if loss_only else am.bool()
        if self._shared:
            return packing.Layout.shared_of(am, need, cpu_mb.input_ids, cpu_mb.loss_mask).to(self.device)
        return packing.Layout.of(am, need).to(self.device)

    def _prompt_keys(self, batch: Batch) -> list[tuple[bytes, int]] | None:
        """Each sample's prompt (``packing.prompt_keys``) when ``batch`` trains with prompts shared, else None."""
        return packing.prompt_keys(batch.input_ids, batch.loss_mask) if self._packs(batch) and self._shared else None

    def _micro_batches(self, batch: Batch, budget: int | None = None) -> list[list[int]]:
        """The micro-batches of ``batch`` (sample indices): packed or padded, prompts shared or not."""
        lengths = [int(x.numel()) for x in batch.input_ids]
        return packing.micro_batches(self.cfg, lengths, self._packs(batch), budget, self._prompt_keys(batch))

    def _policy_out(self, model: nn.Module, mb: LossInputs,
                    with_entropy: bool, start: int = 0,
                    layout: packing.Layout | None = None) -> LossOutputs:
        """Logprobs (and entropy) of ``mb``; with ``start`` (``head_start``) the head runs only
        from that position on (Hugging Face's ``logits_to_keep``) and earlier positions hold 0.
        With a packed ``layout`` (``packing.py``) the head runs only at the tokens it marks;
        other positions hold 0."""
        ids, am = mb.input_ids, mb.attention_mask
        if layout is not None:
            chunk, kernel = self.cfg.logprob_chunk_rows, None if self.cfg.kernels else False
            with self._autocast():
                return packing.logprobs(model, ids, layout, self.temperature, with_entropy,
                                        functools.partial(target_logprobs, chunk_rows=chunk, kernel=kernel),
                                        _keeps_logits(type(model)))
        start = start if _keeps_logits(type(model)) else 0
        keep = {"logits_to_keep": ids.shape[1] - start} if start else {}
        # Routing replay: the engine's recorded experts, kept set for a checkpointed backward.
        routing.set_replay(model, mb.routes)
        with self._autocast():
            logits = model(**model_inputs(mb, self.cfg.attention_mask), use_cache=False, **keep).logits
        lp, ent = self._token_logprobs(logits, ids[:, start:], am[:, start:], self.temperature, with_entropy)
        return LossOutputs(F.pad(lp, (start, 0)), None if ent is None else F.pad(ent, (start, 0)))

    def _values_out(self, mb: LossInputs) -> torch.Tensor:
        with self._autocast():
            v = self.critic(**model_inputs(mb, self.cfg.attention_mask))
        return shift_right(v, mb.attention_mask)

    @torch.no_grad()
    def _per_sample(self, batch: Batch, fn) -> list[torch.Tensor]:
        lengths = [int(x.numel()) for x in batch.input_ids]
        result: list[torch.Tensor | None] = [None] * len(batch)
        for idx in self._micro_batches(batch):
            mb = collate(batch, idx, self.pad_token_id, self.cfg.pad_multiple)
            values = fn(self._to_device(mb), self._layout(mb, loss_only=False)).float().cpu()
            for row, i in enumerate(idx):
                result[i] = values[row, : lengths[i]].clone()
        return result  # type: ignore[return-value]

    def logprobs(self, batch: Batch) -> list[torch.Tensor]:
        self.compute.eval()
        return self._per_sample(batch, lambda mb, layout: self._policy_out(self.compute, mb, False,
                                                                           layout=layout).logprobs)

    def ref_logprobs(self, batch: Batch) -> list[torch.Tensor]:
        if self.reference is None:
            raise RuntimeError("ref_logprobs needs a frozen reference model; set trainer.reference=true")
        return self._per_sample(batch, lambda mb, layout: self._policy_out(self.reference, mb, False,
                                                                           layout=layout).logprobs)

    def values(self, batch: Batch) -> list[torch.Tensor]:
        if self.critic is None:
            raise RuntimeError("values needs a critic; set trainer.critic=true")
        self.critic.eval()
        return self._per_sample(batch, lambda mb, layout: self._values_out(mb))

    # ------------------------------------------------------------------- train
    def train(self, batch: Batch, loss_fn: LossFn, publish=None, publish_dtype=None) -> dict[str, float]:
        """``publish``, if given, is called once with the new weights (``named_weights(publish_dtype)``
        as an iterator that runs the last optimizer step while it is consumed, ``streamed.py``); a
        publish that raises still leaves a whole step, and its error is raised after it."""
        if len(batch) == 0:
            raise ValueError("LocalTrainer.train: the batch is empty; the loop must pass at least one sample")
        loss_fn = self._declared(loss_fn, batch)
        start = time.perf_counter()
        chunks = split_even(len(batch), self.cfg.mini_batches)
        lr = self.optimizer.param_groups[0]["lr"]
        means = MetricMean()
        totals = {"loss": 0.0, "grad_norm": 0.0, "critic_grad_norm": 0.0, "microbatches": 0, "inert": 0}
        self.compute.train()
        if self.critic is not None:
            self.critic.train()
        try:
            with profiled(self.cfg, self._step, getattr(self, "rank", 0), self.device):
                for epoch in range(self.cfg.ppo_epochs):
                    for k, idx in enumerate(chunks):
                        last = epoch == self.cfg.ppo_epochs - 1 and k == len(chunks) - 1
                        self._publish = (publish, publish_dtype) if last and publish is not None else None
                        self._update(batch.select(idx), loss_fn, means, totals, f"epoch {epoch}, mini-batch {k}")
        finally:
            self._publish = None
            # Gradients are as large as the model; free them between steps so
            # a colocated engine can use the memory.
            self._zero_grad()
            self.compute.eval()
        updates = self.cfg.ppo_epochs * len(chunks)
        return self._end_step(start, lr, means, totals, updates, batch.num_tokens, len(batch))

    def _end_step(self, start: float, lr: float, means: MetricMean, totals: dict, updates: int,
                  num_tokens: int, num_seqs: int) -> dict[str, float]:
        """After a step's optimizer work: schedulers and step count, then the step's metrics."""
        self.scheduler.step()
        if self.critic_scheduler is not None:
            self.critic_scheduler.step()
        self._step += 1
        metrics = {
            "loss": totals["loss"] / updates, "grad_norm": totals["grad_norm"] / updates, "lr": lr,
            "num_tokens": float(num_tokens), "num_seqs": float(num_seqs),
            "microbatches": float(totals["microbatches"]),
        }
        if self.critic is not None:
            metrics["critic_grad_norm"] = totals["critic_grad_norm"] / updates
        # Samples left out of forward and backward, having no loss term (LossFn.inert; one rank only).
        metrics["inert_frac"] = totals.get("inert", 0) / max(num_seqs * self.cfg.ppo_epochs, 1)
        for key, value in means.result().items():
            metrics[f"loss_fn/{key}" if key in metrics else key] = value
        differs = routing.replay_differs(self.compute)  # routing replay: how often it overrode the router
        if differs is not None:
            metrics["routing_replay_differs"] = differs
        # The step (time_s, the loop's weight-sync clock) ends with its optimizer kernels; a streamed
        # publish times that on the device (a device-wide synchronize would wait for its sends).
        stepped, self._stepped = self._stepped, None
        if stepped is None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_ended = stepped.ended() if stepped is not None else time.time()
        metrics["time_s"] = time.perf_counter() - start
        if self.device.type == "cuda":
            # Allocator retries (a cudaFree/cudaMalloc storm when varying shapes fragment the
            # cache) and the peak are what to look at when a step is slower than its kernels.
            stats = torch.cuda.memory_stats(self.device)
            metrics["cuda_alloc_retries"] = float(stats.get("num_alloc_retries", 0))
            metrics["cuda_peak_gib"] = stats.get("allocated_bytes.all.peak", 0) / 2**30
        error, self._publish_error = self._publish_error, None
        if error is not None:
            raise error
        return metrics

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.compute is not self.model:  # a backward that failed part-way may leave some behind
            self.compute.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)

    def _declared(self, loss_fn, batch: Batch) -> LossFn:
        """``loss_fn`` as a ``LossFn`` (``as_loss_fn``), refused by name when ``batch`` or this trainer
        lacks what it declares it needs."""
        loss_fn = as_loss_fn(loss_fn)
        lacking = loss_fn.needs.missing(batch, self.critic is not None)
        if lacking is not None:
            raise ValueError(f"loss_fn {loss_name(loss_fn)} reads {lacking}")
        return loss_fn

    def _update(self, mini: Batch, loss_fn: LossFn, means: MetricMean, totals: dict, where: str) -> None:
        """One optimizer step on one mini-batch: accumulate micro-batch gradients, clip, step. Samples
        the loss declares inert (``LossFn.inert``) are left out with the whole mini-batch's normalisers
        (the same gradient); with none left the step runs on zero gradients, as AdamW would have."""
        self._zero_grad()
        loss_fn = as_loss_fn(loss_fn)
        live = live_samples(mini, loss_fn)
        totals["inert"] += len(mini) - len(live)
        self._backward(mini.select(live), loss_fn, max(float(mini.num_tokens), 1.0), len(mini),
                       self.cfg.micro_batch_tokens, means, totals, where)
        if not live:
            for p in (p for group in self.optimizer.param_groups for p in group["params"]):
                p.grad = torch.zeros_like(p)
        self._step_optimizers(totals, where)

    def _backward(self, mini: Batch, loss_fn: LossFn, num_tokens: float, num_seqs: int, budget: int,
                  means: MetricMean, totals: dict, where: str) -> None:
        """Forward and backward of ``mini`` in micro-batches of ``budget`` tokens, gradients summed."""
        pending = []  # per micro-batch: loss, metrics, loss tokens, still on the device
        plans = self._micro_batches(mini, budget)
        ahead = self._host_part(mini, plans[0]) if plans else None
        for j in range(len(plans)):
            cpu_mb, mb, layout = ahead
            out = self._policy_out(self.compute, mb, loss_fn.needs.entropy, head_start(cpu_mb), layout)
            # The next micro-batch's host work (collate, packed layout, copies) while the GPU runs
            # this forward: done after the backward, it left the GPU idle for its whole length.
            ahead = self._host_part(mini, plans[j + 1]) if j + 1 < len(plans) else None
            if self.critic is not None:
                out = dataclasses.replace(out, values=self._values_out(mb))
            loss, metrics = loss_fn(out, mb, num_tokens, num_seqs)
            self._check_loss_type(loss, f"{where}, micro-batch {j}")
            loss.backward()
            pending.append((loss.detach(), metrics, mb.loss_mask.sum()))
        # Values reach the host once per mini-batch: a read per micro-batch would stall the
        # GPU queue each time (the CPU waits, then the GPU waits for the next launches).
        for j, (value, metrics, weight) in enumerate(to_host(pending, self.device)):
            totals["loss"] += self._check_finite(value, f"{where}, micro-batch {j}")
            totals["microbatches"] += 1
            means.add(metrics, weight)

    def _host_part(self, mini: Batch, idx: list[int]):
        """A micro-batch's host tensors, their device copies and its packed layout (or None)."""
        cpu_mb = collate(mini, idx, self.pad_token_id, self.cfg.pad_multiple)
        return cpu_mb, self._to_device(cpu_mb), self._layout(cpu_mb, loss_only=True)

    def _step_optimizers(self, totals: dict, where: str) -> None:
        """Clip (and log the norms of) the accumulated gradients, then step policy and critic."""
        totals["grad_norm"] += self._clip(self.model.parameters(), f"{where} (policy)")
        if self.critic is not None:
            totals["critic_grad_norm"] += self._clip(self.critic.parameters(), f"{where} (critic)")
            self.critic_optimizer.step()
        if self._publish is None:
            self.optimizer.step()
            self._refresh_compute()
            return
        publish, dtype = self._publish
        if dtype not in self._plans:  # listed once: the tensors are updated in place
            self._plans[dtype] = StreamPlan(list(self.named_weights(dtype)), self._copies,
                                            list(self.model.parameters()))
        self._stepped = self._plans[dtype]
        self._publish_error = self._stepped.run(self.optimizer, publish)

    def _check_loss(self, loss: Any, where: str) -> float:
        self._check_loss_type(loss, where)
        return self._check_finite(float(loss.detach()), where)

    @staticmethod
    def _check_loss_type(loss: Any, where: str) -> None:
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise TypeError(f"loss_fn must return a scalar tensor as its loss ({where}); "
                            f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        if not loss.requires_grad:
            raise TypeError(f"loss_fn returned a loss without gradient ({where}); build it from out.logprobs")

    def _check_finite(self, value: float, where: str) -> float:
        if not math.isfinite(value):
            raise NonFiniteLossError(
                f"trainer step {self._step}, {where}: loss is {value}; no optimizer step was taken "
                "(check the loss inputs, e.g. advantages and logprob ratios, and the learning rate)")
        return value

    def _clip(self, params, where: str) -> float:
        params = [p for p in params if p.grad is not None]
        # max_norm=inf makes clip_grad_norm_ a pure norm computation (coef clamps to 1).
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        if not math.isfinite(norm):
            raise NonFiniteLossError(
                f"trainer step {self._step}, {where}: gradient norm is {norm}; no optimizer step was taken "
                "(the loss is finite but its gradient is not; check for log(0) or division by ~0 in the loss)")
        return norm

    # ----------------------------------------------------- weights and files
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Live policy tensors (no copy) named as in ``state_dict()``; copy before the next train().
        With ``dtype`` equal to the compute copy's (bf16 engines), the copy's linear weights (the
        masters rounded the same way, no cast at publish time) and the other float32 masters
        as they are: transports cast while they copy. The list is made once (the tensors are
        updated in place), so a publish costs no state_dict walk, cast or allocation.
        With ``trainer.lora`` the merged weights or the adapters alone (``lora.published``)."""
        if self.cfg.lora.enabled:
            yield from lora.published(self.model.state_dict().items(), self.cfg.lora)
            return
        if not self._copies or dtype != self._dtype:
            yield from self.model.state_dict().items()
            return
        if self._publish_list is None:
            self._publish_list = list(self.compute.state_dict().items())
        yield from self._publish_list

    def training_state(self) -> dict[str, Any]:
        """Optimizer, scheduler and step state (everything but weights and RNG) for checkpoints."""
        state = {"step": self._step, "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict()}
        if self.critic_optimizer is not None:
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
            state["critic_scheduler"] = self.critic_scheduler.state_dict()
        return state

    def load_training_state(self, state: dict[str, Any]) -> None:
        has_critic = "critic_optimizer" in state
        if has_critic != (self.critic is not None):
            raise ValueError(
                f"checkpoint {'has' if has_critic else 'has no'} critic but this trainer "
                f"{'has none' if has_critic else 'has one'}; set trainer.critic={str(has_critic).lower()}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if has_critic:
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
            self.critic_scheduler.load_state_dict(state["critic_scheduler"])
        self._step = int(state["step"])

    def save(self, path: str | Path, extra: dict[str, Any] | None = None, wait: bool = True) -> None:
        """A checkpoint. ``wait=False`` with ``trainer.async_checkpoint``: its files are written while
        training goes on (the next save, load or export, or ``wait_saved``, waits for them)."""
        self.wait_saved()
        if self.cfg.async_checkpoint and not wait:
            self._saving = checkpoint.save_checkpoint_async(self, path, extra or {})
        else:
            checkpoint.save_checkpoint(self, path, extra or {})

    def wait_saved(self) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.wait()

    def load(self, path: str | Path) -> dict[str, Any]:
        self.wait_saved()
        extra = checkpoint.load_checkpoint(self, path)
        self._refresh_compute()
        return extra

    def export_hf(self, path: str | Path) -> None:
        self.wait_saved()
        if self.cfg.lora.enabled:  # the merged model, its adapter in path/adapter
            lora.export_model(self.model, self.cfg.lora, path, self.source_dir)
            return
        checkpoint.export_policy(self, path)
