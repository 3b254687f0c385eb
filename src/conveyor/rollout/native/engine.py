"""NativeEngine: the built-in rollout engine (CPU or one GPU), a ``RolloutEngine``.

Contract: ``conveyor.rollout.api`` states what every engine promises; ``NativeEngine`` keeps it
with either of two model runners, the paged CUDA-graph runner (``graph_runner.py``) or the
Hugging Face runner (``runner.py``, the logged fallback).
- ``generate`` and, on the paged runner, ``generate_stream`` (continuous batching); a sample
  depends only on its prompt, the seed and the weights.
- ``update_weights`` lands between two decode steps; optional 8-bit weights (``quant.py``) are
  re-quantised by it.
The class and ``generate_stream`` docstrings have the details.

It knows nothing of tasks, rewards, trajectories, weight transports or where
chunks come from. One ``generate`` or ``generate_stream`` runs at a time.
"""
from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from conveyor.runtime.devices import native_bf16, native_dtype
from conveyor.rollout.api import Completion, SamplingParams, StreamChunk, capped_budgets
from conveyor.rollout.native.adapter import AdapterMerge, is_adapter_tensor
from conveyor.rollout.native.decoder import unsupported_reason
from conveyor.rollout.native.graph_runner import PagedGraphRunner
from conveyor.rollout.native.paged_loop import PagedLoop, check_fits_pool
from conveyor.rollout.native.quant import runner_for
from conveyor.rollout.native.runner import HFModelRunner, KVBatch
from conveyor.rollout.native.sampling import draw_seeds, request_key, sample
from conveyor.rollout.native.scheduler import Request, Scheduler, StopRule

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config import RolloutConfig

log = logging.getLogger(__name__)

RUNNERS = ("auto", "fast", "hf")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "auto") -> torch.dtype | None:
    """None / "auto" keep the model's own dtype; "native" is bfloat16 where ``device`` computes it in
    hardware, else float32 (``runtime.devices``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype == "native":
        return _DTYPES[native_dtype(resolve_device(device))[0]]
    if dtype not in _DTYPES:
        raise ValueError(f"NativeEngine dtype {dtype!r} is not one of auto, native, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _use_paged_runner(model, device: torch.device, runner: str) -> bool:
    """The paged fast runner for supported models on a GPU ("auto") or anywhere ("fast"); else HF."""
    if runner == "hf" or (runner == "auto" and device.type != "cuda"):
        return False
    reason = unsupported_reason(model)
    if reason is not None:
        log.warning("NativeEngine: fast runner unavailable (%s); falling back to the Hugging Face runner", reason)
        return False
    return True


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(model, "generation_config", None), model.config, tokenizer]
    for src in sources:
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ids


class NativeEngine:
    """The built-in engine. Takes ownership of ``model``: it is moved, cast and put in eval mode.

    Contract (``conveyor.rollout.api`` states what every engine promises)
    - Two model runners: the paged CUDA-graph runner (``graph_runner.py``, loop in
      ``paged_loop.py``; Llama / Qwen2 / Qwen3; ``runner="auto"`` picks it on a GPU
      for supported models, ``"fast"`` forces it, also on the CPU) and the Hugging
      Face runner (``runner.py``; any causal LM; the logged fallback). Both keep the
      same promises: order, versions, logprobs, context rule, seeding.
    - ``quantization`` ``"fp8"`` / ``"int8"`` (fast runner only, ``quant.py``): the
      linear layers decode from 8-bit copies of their weights, re-quantised by every
      ``update_weights``; refused (``ValueError`` naming the setting) where the fast
      runner cannot run the model or, for fp8, the GPU has no FP8 tensor cores.
    - ``record_experts`` (Hugging Face runner, mixture-of-experts models): every completion
      carries ``routed_experts``, the experts each fed token was routed to (``conveyor.routing``).
    - ``generate(prompts, params)``: every (prompt, sample) is a request, admitted
      into the running batch by ``scheduler.py``; each prompt is prefilled once.
    - ``generate_stream(params, intake, on_done)`` (``streams`` is True: the paged
      runner only): continuous batching over the ``StreamChunk``s ``intake()``
      returns between steps; ``on_done(tag, i, samples)`` as soon as prompt ``i``
      of a chunk has all its samples, with what ``generate`` would return.
    - ``update_weights`` takes the step lock, so a swap lands between two decode
      steps; a token records the version at the start of the step that made it.
    - A sample depends only on its prompt, the seed and the weights (keyed random
      streams, ``sampling.py``); ``pause`` / ``resume`` / ``abort`` control a call.
    - ``generate(prompts, params)``: up to ``max_batch`` requests run; the runner prefills each
      admitted prompt ONCE and replicates its KV to its samples; every step decodes all running
      rows, samples in float32, appends token / logprob / version to each request and removes
      finished rows (and their cache rows) at once. Waiting requests join in admission waves
      (``scheduler.py``). The HF runner keeps a dense left-padded cache.
    - Context: a prompt of ``len(prompt) >= context_limit`` (``max_position_embeddings``, or
      the sliding window when smaller) raises ``ValueError`` naming its index; otherwise
      generation is capped so prompt + completion fits, ending with finish_reason "length".
    - Versions: a token records the version at the start of the step that produced it.
      ``update_weights`` takes the step's lock, so another thread may call it while
      ``generate`` runs (and ``intake`` may, on the generating thread): later tokens carry the
      new version and the KV of earlier tokens is kept (partial rollouts).
    - Randomness: every request draws from its own stream keyed by ``params.seed`` (None: fresh
      entropy), its prompt's index and its sample index, at the index of the token drawn. A
      sample depends on its prompt, the seed and the weights only: not on ``max_batch``, the
      rest of the batch, preemption, overlap or the runner (up to float rounding); prompt i of
      a call seeded s samples as prompt 0 of a call seeded s + i.
    - The reported logprob is ``log_softmax(logits / T)`` at the sampled token before top-k /
      top-p, with the trainer's formula (bit-equal on the same logits; torch's CPU
      ``log_softmax`` is off by up to ~1e-5 at a 49k vocabulary): fp32 parity with the
      trainer on the tiny model is within 1e-5 for both runners (tested).
    """

    def __init__(self, model, tokenizer=None, *, device: str | torch.device = "auto",
                 dtype: str | torch.dtype | None = "auto", max_batch: int = 256,
                 refill: int | None = None, prefill_token_budget: int = 16384, version: int = 0,
                 runner: str = "auto", kv_fraction: float = 0.4, kv_blocks: int | None = None,
                 block_size: int = 16, cuda_graphs: bool = True, prefix_cache: str = "off",
                 quantization: str = "none", record_experts: bool = False):
        if max_batch < 1:
            raise ValueError(f"NativeEngine max_batch must be >= 1, got {max_batch}")
        if runner not in RUNNERS:
            raise ValueError(f"NativeEngine runner {runner!r} is not one of {', '.join(RUNNERS)}")
        dev, dt = resolve_device(device), resolve_dtype(dtype, device)
        runner = runner_for(quantization, runner, dev)
        if dev.type == "cuda":
            # Prefill shapes change with every call; cuDNN's attention would build a graph for
            # each (milliseconds of host time), flash and mem-efficient attention need none.
            torch.backends.cuda.enable_cudnn_sdp(False)
        model = model.to(device=dev, dtype=dt) if dt is not None else model.to(device=dev)
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.refill = refill
        self.paged = _use_paged_runner(model, dev, runner)
        if quantization != "none" and not self.paged:
            raise ValueError(f"rollout.quantization={quantization} needs the fast runner, which cannot run this "
                             f"model ({unsupported_reason(model)}); set rollout.quantization=none")
        if self.paged and record_experts:
            raise ValueError("recording routed experts (algo.routing_replay) needs the Hugging Face runner; "
                             "set rollout.runner=hf")
        if self.paged:
            self.runner = PagedGraphRunner(model, max_batch=max_batch, block_size=block_size, kv_fraction=kv_fraction,
                                     kv_blocks=kv_blocks, cuda_graphs=cuda_graphs,
                                     prefill_token_budget=prefill_token_budget, prefix_cache=prefix_cache,
                                     quantization=quantization)
        else:
            self.runner = HFModelRunner(model, prefill_token_budget, record_experts)
        self.eos_ids = _eos_ids(model, tokenizer)
        why = " (rollout.runner=auto uses it off the GPU, where it measured faster)" if runner == "auto" else ""
        self.label = (f"native engine, paged runner on {dev}" if self.paged
                      else f"native engine, Hugging Face runner on {dev}{why}")
        if dtype == "native":
            self.label += f", rollout.dtype=native: {str(dt).removeprefix('torch.')} ({native_bf16(dev)[1]})"
        if quantization != "none":
            self.label += f", {quantization} linear weights (per-output-channel scales)"
        self._version = int(version)
        # Held for one step at a time, and by update_weights, so a weight swap from
        # another thread lands between decode steps, never inside one.
        self._lock = threading.RLock()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._aborted = False
        self._targets: dict[str, torch.Tensor] | None = None  # name -> parameter or buffer, for swaps
        self._adapters: AdapterMerge | None = None  # adapter-only updates (their base copies), with _targets
        # Running totals of the paged loop's steps (decode steps, rows, seconds), read by workers.
        # device_wait_s: the host blocked on the device (reading a step's tokens before they are ready).
        self.counters = {"decode_steps": 0, "decode_rows": 0, "decode_s": 0.0, "prefill_s": 0.0, "device_wait_s": 0.0}

    @classmethod
    def from_pretrained(cls, path: str, device: str | torch.device = "auto",
                        dtype: str | torch.dtype | None = "auto", **kwargs) -> "NativeEngine":
        """Load model and tokenizer from an HF checkpoint directory (or hub id already cached)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dt = resolve_dtype(dtype, device)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt if dt is not None else "auto",
                                                     attn_implementation="sdpa")
        tokenizer = kwargs.pop("tokenizer", None) or AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, device=device, dtype=dtype if dtype == "native" else dt, **kwargs)

    @classmethod
    def from_config(cls, cfg: "RolloutConfig", model, tokenizer=None, **kwargs) -> "NativeEngine":
        """Engine for ``cfg`` (device, dtype, max_batch); ``model`` is a model object or a checkpoint path."""
        if isinstance(model, str):
            return cls.from_pretrained(model, cfg.device, cfg.dtype, max_batch=cfg.max_batch, **kwargs)
        return cls(model, tokenizer, device=cfg.device, dtype=cfg.dtype, max_batch=cfg.max_batch, **kwargs)

    @property
    def version(self) -> int:
        return self._version

    @property
    def streams(self) -> bool:
        """Whether ``generate_stream`` (continuous batching) is available: the fast runner only."""
        return self.paged

    @property
    def cuda_device(self) -> torch.device | None:
        """The GPU the runner computes on (weight copies are queued there), None on the CPU."""
        device = self.runner.device if self.runner is not None else None
        return device if device is not None and device.type == "cuda" else None

    @property
    def context_limit(self) -> int:
        """Longest prompt + completion this engine serves (prompts must be shorter)."""
        return self.runner.context_limit

    # ----- weights ----------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                       version: int) -> None:
        """Copy each tensor in place into the parameter (or buffer) of that name, then set ``version``.

        Parameters keep their storage (no reallocation), so views held elsewhere
        (CUDA graphs, IPC handles) stay valid. On an error the version is left
        unchanged and nothing is copied (every name and shape is checked first).
        Adapter tensors (``X.lora_A`` / ``X.lora_B``, ``transport/adapter.py``) set ``X.weight``
        to its base plus ``B @ A`` instead (``adapter.py``: each version's delta replaces the last).
        """
        self._check_open()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if self._targets is None:  # built once: a dict of ~300 entries per swap showed in the pause
            self._targets = dict(self.model.named_buffers())
            self._targets.update(self.model.named_parameters(remove_duplicate=False))
            self._adapters = AdapterMerge(self._targets)
        dst, src, names, lora = [], [], [], []
        for name, tensor in items:
            if is_adapter_tensor(name):
                lora.append((name, tensor))
                continue
            target = self._targets.get(name)
            if target is None:
                raise ValueError(f"update_weights: unknown parameter {name!r}; names must match "
                                 f"model.named_parameters() (e.g. {next(iter(self._targets))!r})")
            if target.shape != tensor.shape:
                raise ValueError(f"update_weights: parameter {name!r} has shape {tuple(target.shape)}, "
                                 f"got {tuple(tensor.shape)}; send weights of the same architecture")
            dst.append(target)
            src.append(tensor)
            names.append(name)
        pairs = self._adapters.plan(lora) if lora else []
        with self._lock, torch.no_grad():
            # One foreach call instead of a copy (and a launch) per tensor: decoding pauses
            # for this copy. Checked first, so a bad name or shape copies nothing.
            if dst:
                torch._foreach_copy_(dst, src)
                if self.paged:
                    self.runner.net.requantize(dst)
                for name in names if self._adapters.base else ():
                    self._adapters.rebase(name)  # a full tensor is the new base of its adapter
            if pairs:
                self._adapters.apply(pairs)
                if self.paged:
                    self.runner.net.requantize([self._targets[p.weight] for p in pairs])
            self._version = int(version)

    # ----- generation ---------------------------------------------------------------
    def _capped_requests(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Request]:
        """Prompt i's samples draw from the streams ``request_key(seed, i, j)``."""
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        budgets = capped_budgets(prompts, params, self.runner.context_limit, vocab)
        return [Request(i, j, list(prompt), budget, key=request_key(seed, i, j))
                for i, (prompt, budget) in enumerate(zip(prompts, budgets)) for j in range(params.n)]

    def _stop_rule(self, params: SamplingParams) -> StopRule:
        if params.eos_bias and not self.eos_ids:
            raise ValueError("SamplingParams.eos_bias needs an EOS token; the model config and tokenizer define none")
        return StopRule(self.eos_ids | set(params.stop_token_ids), params.stop_strings, self.tokenizer)

    def _check_pool(self) -> None:
        if not self.runner.holds_memory:
            raise RuntimeError("generate: the KV cache was released; call reacquire_memory() first")

    @staticmethod
    def _seed(seed: int | None) -> int:
        return secrets.randbits(62) if seed is None else int(seed)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self._check_open()
        if not prompts:
            return []
        stop = self._stop_rule(params)
        requests = self._capped_requests(prompts, params, self._seed(params.seed))
        self._aborted = False
        if self.paged:
            self._check_pool()
            check_fits_pool(self.runner, requests)
            with torch.inference_mode():
                PagedLoop(self, params, stop).run(requests)
            return self._completions(requests, len(prompts), params.n)
        sched = Scheduler(requests, self.max_batch, self.refill)
        step = _Step(self, params, stop)
        batch: KVBatch | None = None
        with torch.inference_mode():
            while sched.has_work():
                if not self._wait_unpaused():
                    break
                admitted = sched.admit()
                if admitted:
                    batch = step.admit(batch, admitted, sched)
                if batch is not None:
                    batch = step.decode(batch, sched)
        return self._completions(requests, len(prompts), params.n)

    def generate_stream(self, params: SamplingParams, intake: Callable[[], list[StreamChunk]],
                        on_done: Callable[[Any, int, list[Completion]], None]) -> None:
        """Continuous batching over chunks taken from ``intake()`` (the paged runner only).

        The generating thread calls ``intake()`` between steps, outside the engine's lock, and
        gets ``StreamChunk(tag, prompts, seed)``s, sampled with ``params`` but for the seed (the
        first chunks come from the first call); their requests join the waiting queue of the
        batch already decoding under the same admission policy (KV pool permitting).
        ``on_done(tag, i, samples)`` is called on the generating thread as soon as every sample
        of the chunk's prompt ``i`` has finished, with what ``generate(prompts, params)[i]``
        would return (same capping and validation; a bad prompt raises ``ValueError`` naming the
        chunk and the prompt). A chunk without prompts reports nothing. A chunk with a seed
        samples as ``generate`` with that seed would; one without continues the call's seed over
        the prompts numbered before it. Prompt indices are numbered across the call, so chunks
        never share prompt KV blocks. Returns when nothing runs or waits and ``intake()`` gave
        nothing; ``abort()`` reports every unreported prompt, in order, its unfinished samples
        marked "abort".
        """
        self._check_open()
        if not self.paged:
            raise NotImplementedError("generate_stream needs the fast runner (engine.streams is False)")
        stop = self._stop_rule(params)
        self._check_pool()
        self._aborted = False
        chunks = _StreamChunks(self, params, on_done)

        def feed() -> list[Request]:
            # Outside inference mode, as a weight update from another thread would run.
            with torch.inference_mode(False):
                return chunks.add(intake())

        with torch.inference_mode():
            PagedLoop(self, params, stop).run([], feed, chunks.finished)
        chunks.report_rest()

    def _completions(self, requests: list[Request], num_prompts: int, n: int,
                     first_index: int = 0) -> list[list[Completion]]:
        out: list[list[Completion]] = [[None] * n for _ in range(num_prompts)]  # type: ignore[list-item]
        for r in requests:
            text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True) if self.tokenizer else ""
            routed = torch.cat(r.routes).to(torch.int16).numpy() if r.routes else None
            out[r.prompt_index - first_index][r.sample_index] = Completion(r.token_ids, r.logprobs, r.versions,
                                                                           r.finish_reason or "abort", text, routed)
        return out

    # ----- memory and flow control ----------------------------------------------------
    def release_memory(self) -> None:
        """Free the KV cache (paged runner) so a colocated trainer can use the memory between rollouts."""
        self._check_open()
        with self._lock:
            if self.paged:
                self.runner.release_memory()
            elif torch.cuda.is_available():
                torch.cuda.empty_cache()

    def reacquire_memory(self) -> None:
        """Allocate the KV cache again (a no-op when it is held or the runner keeps no pool)."""
        self._check_open()
        with self._lock:
            if self.paged:
                self.runner.reacquire_memory()

    def pause(self) -> None:
        """Stop scheduling between steps (running requests keep their KV) until ``resume()``."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    def abort(self) -> None:
        """End the ``generate`` in progress: unfinished requests return with finish_reason "abort"."""
        self._aborted = True
        self._unpaused.set()

    def _wait_unpaused(self) -> bool:
        """Block while paused; False once the running call was aborted."""
        self._unpaused.wait()
        return not self._aborted

    def close(self) -> None:
        with self._lock:
            if self.paged and self.runner is not None and self.runner.holds_memory:
                self.runner.release_memory()
            self.model = None
            self.runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.model is None:
            raise RuntimeError("NativeEngine is closed; create a new engine")


@dataclass
class _OpenPrompt:
    """A prompt of a streaming call not reported yet: its chunk's tag, its index there, its samples."""
    tag: Any
    index: int
    requests: list[Request] = field(default_factory=list)


class _StreamChunks:
    """One ``generate_stream`` call's chunks: numbering their prompts, and reporting each
    prompt's samples as soon as they have all finished."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, on_done):
        self.engine, self.params, self.on_done = engine, params, on_done
        self.seed = engine._seed(params.seed)
        self.next_index = 0
        # By prompt index (numbered across the call), dropped once reported.
        self.open: dict[int, _OpenPrompt] = {}

    def add(self, new: list[StreamChunk]) -> list[Request]:
        """Chunks -> their requests, numbered on."""
        out: list[Request] = []
        for chunk in new:
            tag, prompts = chunk.tag, chunk.prompts
            # A chunk's own seed, or the call's continued over the prompts numbered so far.
            seed = chunk.seed if chunk.seed is not None else self.seed + self.next_index
            try:
                requests = self.engine._capped_requests(prompts, self.params, seed) if prompts else []
                check_fits_pool(self.engine.runner, requests)
            except ValueError as exc:
                raise ValueError(f"generate_stream chunk {tag!r}: {exc}") from exc
            # The runner shares prefill and KV blocks by prompt index: numbering prompts
            # across the call keeps equal indices of different chunks apart.
            first = self.next_index
            self.next_index += len(prompts)
            self.open.update({first + i: _OpenPrompt(tag, i) for i in range(len(prompts))})
            for r in requests:
                r.prompt_index += first
                self.open[r.prompt_index].requests.append(r)
            out.extend(requests)
        return out

    def finished(self, requests: list[Request]) -> None:
        for r in requests:
            if r.prompt_index in self.open and all(x.finished for x in self.open[r.prompt_index].requests):
                self._report(r.prompt_index)

    def report_rest(self) -> None:
        """After an abort: every prompt with unfinished samples, in the order they came."""
        for index in sorted(self.open):
            self._report(index)

    def _report(self, index: int) -> None:
        p = self.open.pop(index)
        self.on_done(p.tag, p.index, self.engine._completions(p.requests, 1, self.params.n, index)[0])


class _Step:
    """One generate call's step functions: admission (prefill + first token) and decode."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, stop: StopRule):
        self.engine, self.runner, self.params, self.stop = engine, engine.runner, params, stop
        self.eos = tuple(sorted(engine.eos_ids))

    def admit(self, batch: KVBatch | None, admitted: list[Request], sched: Scheduler) -> KVBatch | None:
        """Prefill each distinct prompt once, replicate its rows to its samples, merge into the batch."""
        with self.engine._lock:
            version = self.engine.version
            first_row: dict[int, int] = {}
            unique: list[list[int]] = []
            for r in admitted:
                if r.prompt_index not in first_row:
                    first_row[r.prompt_index] = len(unique)
                    unique.append(r.prompt_ids)
            new, logits = self.runner.prefill(unique)
            if self.runner.last_routes is not None:  # each sample starts with its prompt's experts
                prompt_routes = [x.cpu() for x in self.runner.last_routes]
                for r in admitted:
                    r.routes.append(prompt_routes[first_row[r.prompt_index]])
            rows = torch.tensor([first_row[r.prompt_index] for r in admitted], dtype=torch.long)
            if len(unique) < len(admitted):
                new = self.runner.select(new, rows)
                logits = logits[rows.to(logits.device)]
            merged = new if batch is None else self.runner.merge(batch, new)
            # Rows already running keep their pending token; only the new rows sample now.
            n_old = 0 if batch is None else batch.size
            return self._sample_rows(merged, logits, n_old, sched, version)

    def _sample_rows(self, merged: KVBatch, logits: torch.Tensor, n_old: int, sched: Scheduler,
                     version: int) -> KVBatch | None:
        p, rows = self.params, sched.running[n_old:]
        seeds = None
        if p.temperature > 0:
            seeds = torch.from_numpy(draw_seeds([r.key for r in rows], [len(r.token_ids) for r in rows]))
        tokens, logprobs = sample(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                  eos_ids=self.eos, eos_bias=p.eos_bias, seeds=seeds)
        merged.last_tok = torch.cat([merged.last_tok[:n_old], tokens])
        for req, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            req.append(tok, lp, version)
            req.finish_reason = self.stop.finish_reason(req)
        keep = sched.retire()
        if not keep:
            return None
        if len(keep) < merged.size:
            merged = self.runner.select(merged, torch.tensor(keep, dtype=torch.long))
        return merged

    def decode(self, batch: KVBatch, sched: Scheduler) -> KVBatch | None:
        with self.engine._lock:
            version = self.engine.version
            logits = self.runner.decode(batch)
            if self.runner.last_routes is not None:  # the experts of the token each row just fed
                for r, routes in zip(sched.running, self.runner.last_routes.cpu().split(1), strict=True):
                    r.routes.append(routes)
            return self._sample_rows(batch, logits, 0, sched, version)
