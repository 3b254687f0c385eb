"""RemoteEngine: any OpenAI-compatible completion server (vLLM's api_server, SGLang) as a rollout engine.

Contract (``conveyor.rollout.api`` states what every engine promises):
``generate`` sends one ``POST /v1/completions`` per prompt (token ids in, ``n``
samples, ``logprobs=1``), up to ``max_concurrency`` at once. Logprobs are the
server's (start vLLM with ``--logprobs-mode processed_logprobs``). A token
records the version when its request was sent; ``update_weights`` waits for
requests in flight and holds new ones back, so no request straddles an update.
``weight_sync``: ``vllm_reload``, ``vllm_nccl``, ``sglang_disk`` (these two have
not run on this project's CPU-only CI) or ``none``. Every HTTP call has a
deadline, retried with backoff on connection failures and 502/503/504; a
broken server raises ``RemoteEngineError`` naming the URL and the fix.

It does not start or stop servers, pick models or know the loop; it speaks HTTP
with the standard library only.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import threading
import time
import urllib.parse
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from conveyor.rollout.api import Completion, SamplingParams
from conveyor.rollout.api import capped_budgets
from conveyor.rollout.vllm_params import eos_logit_bias, finish_reason, sample_seed

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from conveyor.config import RolloutConfig

WEIGHT_SYNCS = ("vllm_reload", "vllm_nccl", "sglang_disk", "none")
_RETRY_STATUS = (502, 503, 504)
_START_HINT = ("start it (e.g. VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model PATH "
               "--logprobs-mode processed_logprobs) or fix rollout.remote_url")


class RemoteEngineError(RuntimeError):
    """The server is unreachable, too slow, or answered something unusable; the message says which and the fix."""


class _HTTP:
    """JSON over HTTP/1.1 with a deadline per call and bounded retries (standard library only)."""

    def __init__(self, base_url: str, timeout_s: float, retries: int, backoff_s: float, api_key: str | None):
        url = urllib.parse.urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"remote engine URL {base_url!r} is not http(s)://host:port; fix rollout.remote_url")
        self.base_url, self.url = base_url.rstrip("/"), url
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _once(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        cls = http.client.HTTPSConnection if self.url.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.url.hostname, self.url.port, timeout=timeout)
        try:
            conn.request(method, self.url.path + path, body=body, headers=self.headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def call(self, method: str, path: str, payload: Any = None, timeout_s: float | None = None,
             retries: int | None = None) -> Any:
        """The decoded JSON answer (None for an empty body); RemoteEngineError after the last failure."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        tries = 1 + (self.retries if retries is None else retries)
        body = None if payload is None else json.dumps(payload).encode()
        where = f"{method} {self.base_url}{path}"
        for attempt in range(tries):
            last = attempt == tries - 1
            try:
                status, data = self._once(method, path, body, timeout)
            except TimeoutError:
                raise RemoteEngineError(f"{where} gave no answer within {timeout:g}s; the server is overloaded "
                                        "or stuck: raise rollout.remote_timeout_s or check the server") from None
            except (ConnectionError, http.client.RemoteDisconnected, OSError) as e:
                if last:
                    raise RemoteEngineError(f"{where} failed after {tries} tries ({type(e).__name__}: {e}); "
                                            f"no server answers there: {_START_HINT}") from None
                time.sleep(self.backoff_s * 2 ** attempt)
                continue
            if status in _RETRY_STATUS and not last:
                time.sleep(self.backoff_s * 2 ** attempt)
                continue
            if status >= 400:
                raise RemoteEngineError(f"{where} answered HTTP {status}: {_short(data)}{_status_hint(path, status)}")
            return json.loads(data) if data.strip() else None
        raise AssertionError("unreachable")  # pragma: no cover


def _short(data: bytes, limit: int = 300) -> str:
    text = data.decode("utf-8", "replace").strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def _status_hint(path: str, status: int) -> str:
    if status == 404 and path.split("?")[0] in ("/collective_rpc", "/pause", "/resume", "/update_weight_version",
                                                "/reset_prefix_cache", "/init_weight_transfer_engine"):
        return "; this endpoint exists only in vLLM's dev mode: start the server with VLLM_SERVER_DEV_MODE=1"
    if status == 404 and path == "/update_weights_from_disk":
        return "; the server is not SGLang: pick the weight_sync that matches it"
    return ""


class _Gate:
    """Many generate calls at once, or one weight update alone (a readers-writer lock)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    def enter_read(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1

    def exit_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def enter_write(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            self._cond.wait_for(lambda: self._readers == 0)

    def exit_write(self) -> None:
        with self._cond:
            self._writing = False
            self._cond.notify_all()


class RemoteEngine:
    """A client of one OpenAI-compatible server; thread-safe.

    - Completion ids come from the choice's ``token_ids`` (vLLM's ``return_token_ids``) or else
      the ``token_id:N`` strings ``return_tokens_as_token_ids`` puts in ``logprobs.tokens``; a
      length that disagrees with ``token_logprobs`` fails naming the server. Greedy ``n > 1``
      asks for one sample and copies it (vLLM refuses greedy ``n > 1``).
    - Logprobs: vLLM's default ``raw_logprobs`` ignores temperature; ``processed_logprobs``
      means what ``rollout.vllm`` says with top-k / top-p.
    - ``weight_sync``: ``vllm_reload`` writes one safetensors file to a private directory
      (``/dev/shm`` by default: the server runs on this host or shares ``shm_dir``) and calls
      the dev-mode routes ``/pause?mode=keep``, ``/collective_rpc`` (``reload_weights``),
      ``/update_weight_version``, ``/reset_prefix_cache``, ``/resume`` (start vLLM with
      ``VLLM_SERVER_DEV_MODE=1``); ``vllm_nccl`` broadcasts over NCCL through
      ``/init_weight_transfer_engine`` ... ``/finish_weight_update`` (needs the vllm package
      here, a GPU, and a server started with ``--weight-transfer-config '{"backend":
      "nccl"}'``); ``sglang_disk`` writes a checkpoint directory and calls SGLang's
      ``/update_weights_from_disk``; ``none`` records the version (something else pushes).
    - Every call's deadline is ``request_timeout_s``; connection failures and 502/503/504 are
      retried ``retries`` times with backoff, other errors not.
    """

    streams = False  # no generate_stream: engine workers serve it in waves
    cuda_device = None  # update_weights returns once the weights are in place

    @property
    def counters(self) -> dict[str, float]:
        """No decode-step totals are kept."""
        return {}

    def __init__(self, base_url: str, tokenizer=None, *, model: str | None = None, weight_sync: str = "none",
                 request_timeout_s: float = 600.0, ready_timeout_s: float = 30.0, retries: int = 2,
                 backoff_s: float = 0.25, max_concurrency: int = 64, api_key: str | None = None,
                 context_limit: int | None = None, eos_ids: Iterable[int] = (), version: int = 0,
                 shm_dir: str | None = None, model_path: str | None = None, nccl_master_address: str = "127.0.0.1"):
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"RemoteEngine weight_sync {weight_sync!r} is not one of {', '.join(WEIGHT_SYNCS)}")
        if max_concurrency < 1:
            raise ValueError(f"RemoteEngine max_concurrency must be >= 1, got {max_concurrency}")
        self.http = _HTTP(base_url, request_timeout_s, retries, backoff_s, api_key or os.environ.get("OPENAI_API_KEY"))
        self.tokenizer, self.weight_sync, self.model_path = tokenizer, weight_sync, model_path
        self.nccl_master_address = nccl_master_address
        self.eos_ids = set(int(i) for i in eos_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))
        self._version = int(version)
        self._gate = _Gate()
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="conveyor-remote")
        self._shm = Path(shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")) / \
            f"conveyor-remote-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The weight file lives in RAM: remove it even when close() is never called.
        weakref.finalize(self, shutil.rmtree, str(self._shm), True)
        self._sender = self._source = None
        self.last_update_ms: float | None = None
        self.closed = False
        self.wait_ready(ready_timeout_s)
        card = self._model_card(model)
        self.model = card["id"]
        self.context_limit = context_limit or card.get("max_model_len")
        self.label = f"remote server {base_url} ({self.model})"
        self.vocab_size = len(tokenizer) if tokenizer is not None else None

    @classmethod
    def from_config(cls, cfg: "RolloutConfig", model_path: str | None, tokenizer=None, **kwargs) -> "RemoteEngine":
        url = getattr(cfg, "remote_url", None)
        if not url:
            raise ValueError("rollout.engine=remote needs rollout.remote_url (e.g. http://127.0.0.1:8000)")
        opts = dict(model=getattr(cfg, "remote_model", None), weight_sync=getattr(cfg, "remote_weight_sync", "none"),
                    request_timeout_s=getattr(cfg, "remote_timeout_s", 600.0), model_path=model_path)
        from conveyor.rollout.vllm import checkpoint_eos_ids
        if model_path and Path(model_path).is_dir():
            opts["eos_ids"] = checkpoint_eos_ids(model_path, tokenizer)
        opts.update(kwargs)
        return cls(url, tokenizer, **opts)

    @property
    def version(self) -> int:
        return self._version

    # ----- health -----------------------------------------------------------------------
    def healthy(self, timeout_s: float = 5.0) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout_s``."""
        try:
            self.http.call("GET", "/health", timeout_s=timeout_s, retries=0)
            return True
        except RemoteEngineError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers, or raise after ``timeout_s`` (one try when 0)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if self.healthy(timeout_s=max(1.0, min(5.0, remaining))):
                return
            if remaining <= 0:
                raise RemoteEngineError(f"no healthy server at {self.http.base_url} (GET /health) within "
                                        f"{timeout_s:g}s: {_START_HINT}")
            time.sleep(min(0.5, max(0.05, remaining)))

    def _model_card(self, model: str | None) -> dict:
        cards = (self.http.call("GET", "/v1/models") or {}).get("data") or []
        if model is None:
            if not cards:
                raise RemoteEngineError(f"{self.http.base_url}/v1/models lists no model; set rollout.remote_model")
            return cards[0]
        for card in cards:
            if card.get("id") == model:
                return card
        names = ", ".join(str(c.get("id")) for c in cards) or "none"
        raise RemoteEngineError(f"{self.http.base_url} does not serve model {model!r} (it serves: {names}); "
                                "fix rollout.remote_model")

    # ----- generation -------------------------------------------------------------------
    def _body(self, prompt: list[int], params: SamplingParams, budget: int, seed: int | None, n: int) -> dict:
        body = {
            "model": self.model, "prompt": list(prompt), "n": n, "max_tokens": budget,
            "temperature": params.temperature, "top_p": params.top_p,
            # -1 disables top-k in both vLLM and SGLang (vLLM also takes 0).
            "top_k": params.top_k if params.top_k > 0 else -1,
            "min_p": 0.0, "repetition_penalty": 1.0, "logprobs": 1,
            "stop": list(params.stop_strings), "include_stop_str_in_output": True,
            "stop_token_ids": sorted(self.eos_ids | set(params.stop_token_ids)),
            "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": True,
        }
        if seed is not None:
            body["seed"] = seed
        bias = eos_logit_bias(self.eos_ids, params.eos_bias)
        if bias:
            body["logit_bias"] = {str(k): v for k, v in bias.items()}
        return body

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self._check_open()
        if not prompts:
            return []
        budgets = capped_budgets(prompts, params, self.context_limit or 1 << 62, self.vocab_size)
        copies = params.n if params.temperature == 0 else 1
        self._gate.enter_read()
        try:
            version = self._version
            futures = [self._pool.submit(self._one, self._body(p, params, b, sample_seed(params.seed, i, params.n),
                                                                params.n // copies), version)
                       for i, (p, b) in enumerate(zip(prompts, budgets))]
            groups = [f.result() for f in futures]
        finally:
            self._gate.exit_read()
        return [[Completion(list(c.token_ids), list(c.logprobs), list(c.versions), c.finish_reason, c.text)
                 for c in group for _ in range(copies)] for group in groups]

    def _one(self, body: dict, version: int) -> list[Completion]:
        answer = self.http.call("POST", "/v1/completions", body)
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != body["n"]:
            raise RemoteEngineError(f"{self.http.base_url}/v1/completions returned {len(choices)} choices for "
                                    f"n={body['n']}; the server does not honour n")
        return [self._completion(c, version) for c in choices]

    def _completion(self, choice: dict, version: int) -> Completion:
        lp = choice.get("logprobs") or {}
        logprobs = [float(x) if x is not None else float("nan") for x in lp.get("token_logprobs") or []]
        ids = choice.get("token_ids")
        from_strings = _ids_from_token_strings(lp.get("tokens") or [])
        if ids is None:
            ids = from_strings
        if ids is None or len(ids) != len(logprobs) or (from_strings is not None and from_strings != list(ids)):
            raise RemoteEngineError(
                f"{self.http.base_url}/v1/completions gave no usable completion token ids with logprobs "
                f"({0 if ids is None else len(ids)} ids, {len(logprobs)} logprobs); the server must support "
                "return_token_ids or return_tokens_as_token_ids (vLLM >= 0.10.2, SGLang)")
        ids = [int(t) for t in ids]
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None \
            else choice.get("text", "")
        return Completion(ids, logprobs, [version] * len(ids), finish_reason(choice.get("finish_reason")), text)

    # ----- weights ----------------------------------------------------------------------
    def update_weights(self, named_tensors: "Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]",
                       version: int) -> None:
        """Push weights to the server by ``weight_sync`` and set ``version``; waits for requests in flight."""
        self._check_open()
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self._gate.enter_write()
        try:
            t0 = time.perf_counter()
            if self.weight_sync == "vllm_reload":
                self._vllm_reload(items, version)
            elif self.weight_sync == "vllm_nccl":
                self._vllm_nccl(items, version)
            elif self.weight_sync == "sglang_disk":
                self._sglang_disk(items, version)
            self._version = int(version)
            self.last_update_ms = (time.perf_counter() - t0) * 1e3
        finally:
            self._gate.exit_write()

    def _write_safetensors(self, items) -> Path:
        from safetensors.torch import save_file

        self._shm.mkdir(parents=True, exist_ok=True)
        tensors, seen = {}, set()
        for name, t in items:
            t = t.detach().to("cpu").contiguous()
            t = t.clone() if t.data_ptr() in seen else t  # safetensors refuses shared storage
            seen.add(t.data_ptr())
            tensors[name] = t
        save_file(tensors, str(self._shm / "model.safetensors.tmp"))
        # The server globs *.safetensors in the directory: the rename makes the new file appear whole.
        os.replace(self._shm / "model.safetensors.tmp", self._shm / "model.safetensors")
        return self._shm

    def _vllm_reload(self, items, version: int) -> None:
        path = self._write_safetensors(items)
        # "keep" freezes other clients' requests with their KV; they resume on the new weights.
        self.http.call("POST", "/pause?mode=keep")
        try:
            self.http.call("POST", "/collective_rpc", {"method": "reload_weights",
                                                       "kwargs": {"weights_path": str(path)}})
            self.http.call("POST", "/update_weight_version", {"new_version": str(int(version))})
            self.http.call("POST", "/reset_prefix_cache")
        finally:
            self.http.call("POST", "/resume")

    def _vllm_nccl(self, items, version: int) -> None:
        from conveyor.rollout.vllm import tensor_source, trainer_sender
        if self._sender is None:
            workers = int(self.http.call("GET", "/get_world_size?include_dp=false")["world_size"])
            self._source = tensor_source()
            self._source.items = items
            self._sender = trainer_sender("nccl", _HTTPSyncClient(self.http), self._source, workers,
                                          self.nccl_master_address)
        self._source.items = items
        self._sender.send_weights()
        self.http.call("POST", "/update_weight_version", {"new_version": str(int(version))})
        self.http.call("POST", "/reset_prefix_cache")

    def _sglang_disk(self, items, version: int) -> None:
        path = self._write_safetensors(items)
        # SGLang loads a checkpoint directory: the config files travel with the weights.
        for name in ("config.json", "generation_config.json"):
            src = Path(self.model_path or "") / name
            if src.is_file():
                shutil.copy(src, path / name)
        answer = self.http.call("POST", "/update_weights_from_disk",
                                {"model_path": str(path), "weight_version": str(int(version))})
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RemoteEngineError(f"{self.http.base_url}/update_weights_from_disk refused the weights: "
                                    f"{answer.get('message', answer)}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._sender is not None:
            self._sender.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._shm, ignore_errors=True)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("RemoteEngine is closed; create a new engine")


def _ids_from_token_strings(tokens: list[str]) -> list[int] | None:
    """Ids from ``return_tokens_as_token_ids`` strings (``token_id:42``); None if they are plain text."""
    ids = []
    for tok in tokens:
        if not isinstance(tok, str) or not tok.startswith("token_id:"):
            return None
        ids.append(int(tok.split(":", 1)[1]))
    return ids


class _HTTPSyncClient:
    """vLLM's weight-sync client protocol over the dev-mode RL routes."""

    def __init__(self, http: _HTTP):
        self.http = http

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.http.call("POST", "/init_weight_transfer_engine", {"init_info": init_info}, retries=0)

    def shutdown_weight_transfer_engine(self) -> None:
        self.http.call("POST", "/shutdown_weight_transfer_engine", retries=0)

    def start_weight_update(self) -> None:
        self.http.call("POST", "/start_weight_update", retries=0)

    def update_weights(self, update_info) -> None:
        self.http.call("POST", "/update_weights", {"update_info": update_info}, retries=0)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self.http.call("POST", "/finish_weight_update", body, retries=0)
