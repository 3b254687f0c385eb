"""Model runner: prefill and decode steps of a Hugging Face causal LM over a left-padded batch.

- ``HFModelRunner``: ``prefill(prompts)`` makes a ``KVBatch`` (the running rows and their KV
  cache) and ``decode(batch)`` steps it, both returning float32 logits; ``select`` and ``merge``
  are the only ways rows move.
- Left padding never changes results: every row gets its own position ids and the runner
  builds the attention mask itself ("sdpa" and "eager" attention only).

This is the one module that knows Hugging Face internals: the forward keyword
for the cache (``cache`` in recent transformers, ``past_key_values`` before) and
the per-layer ``keys`` / ``values`` tensors of ``DynamicCache``. It serves any
causal LM; Llama-family models on a GPU get the paged ``graph_runner.PagedGraphRunner``
instead (see ``engine.py``). It knows nothing of sampling, requests or stop
conditions.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from conveyor.routing import RouterTaps

SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass
class KVBatch:
    """A ``KVBatch`` holds the running rows: the model's KV cache, a boolean key mask
    ``[B, L]`` (False = left padding), the position id of the next token to feed
    ``[B]`` and that token ``[B]``. Rows are in the order the caller keeps its
    requests; ``select`` and ``merge`` are the only ways rows move.
    """
    cache: object  # transformers DynamicCache
    mask: torch.Tensor  # [B, L] bool, True where the key is a real token
    next_pos: torch.Tensor  # [B] long, position id of the token fed next
    last_tok: torch.Tensor  # [B] long, the token fed next (the latest sample)

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])


def _layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None or any(not hasattr(layer, "keys") or layer.keys is None for layer in layers):
        raise TypeError(f"NativeEngine runner: expected a DynamicCache with per-layer keys/values, got "
                        f"{type(cache).__name__}; this model's cache layout is not supported")
    return layers


def context_limit(config) -> int:
    """Longest prompt + completion the model can attend over in one dense cache."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    limit = int(getattr(text, "max_position_embeddings", None) or 1 << 30)
    window = getattr(text, "sliding_window", None)
    # The runner keeps every key and applies full causal attention, which equals
    # sliding-window attention only while the sequence fits inside the window.
    if window and getattr(text, "use_sliding_window", True):
        limit = min(limit, int(window))
    return limit


def _contiguous_input(module, args):
    return (args[0].contiguous(), *args[1:])


def _contiguous_head_input(model) -> None:
    """Give the model's output head contiguous inputs (once per model). A prefill keeps the logits of
    each prompt's last position (``logits_to_keep``): a ``[B, 1, H]`` view with the whole prompt's
    batch stride, which torch's matmul does not fold into one GEMM; it multiplied each row by its own
    copy of the ``[H, V]`` head weight instead (32 SmolLM2 prompts of 46 tokens, 2-core AMD EPYC:
    a prefill took 1.8 s, 0.56 s with the copy of the ``[B, 1, H]`` input)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module) and _contiguous_input not in head._forward_pre_hooks.values():
        head.register_forward_pre_hook(_contiguous_input)


class HFModelRunner:
    """Runs prefill and decode forwards of one HF causal LM (eval mode, caller holds inference_mode).

    - ``prefill(prompts)`` returns a new ``KVBatch`` (one row per prompt) and the
      float32 next-token logits ``[U, V]`` of each prompt's last token.
    - ``decode(batch)`` feeds ``batch.last_tok`` at ``batch.next_pos``, grows the
      cache by one column and returns float32 logits ``[B, V]``.
    - ``record_experts`` (mixture-of-experts models): after each ``prefill`` /
      ``decode``, ``last_routes`` holds the experts every fed token was routed to
      (per prompt ``[len, layers, k]`` / per row ``[B, layers, k]``).
    - ``select(batch, rows)`` keeps (or repeats) rows by index and drops leading
      columns that became padding in every row, so finished sequences stop costing
      compute and memory. ``merge(a, b)`` left-pads the shorter batch and stacks the
      rows of ``b`` after those of ``a`` (continuous admission of new prompts).
    - Left padding never changes results: every row gets its own position ids and
      the runner builds the 4-D additive attention mask itself (causal, padded keys
      masked, the diagonal always open so pad queries never see an all-masked row,
      which would make NaNs that leak into the cache). Supported attention
      implementations are therefore the mask-taking ones, "sdpa" and "eager".
    """

    def __init__(self, model, prefill_token_budget: int = 16384, record_experts: bool = False):
        impl = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(f"NativeEngine: attention implementation {impl!r} is not supported; load the model "
                             f"with attn_implementation='sdpa' (or 'eager')")
        self.model = model
        _contiguous_head_input(model)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_last = "logits_to_keep" in params
        self.prefill_token_budget = prefill_token_budget
        self.context_limit = context_limit(model.config)
        # Mixture of experts: the experts the last prefill (one [len, layers, k] per prompt, in
        # order) or decode ([B, layers, k]) routed each fed token to; None when not recording.
        self.taps = RouterTaps.of(model) if record_experts else None
        if self.taps is not None:
            self.taps.start_recording()
        self.last_routes: list[torch.Tensor] | torch.Tensor | None = None

    # ----- forwards -------------------------------------------------------------
    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """Bool mask -> additive float mask in the model dtype (works for sdpa and eager)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def _forward(self, ids, attn, pos, cache, keep_last: bool):
        from transformers import DynamicCache

        kwargs = {self._cache_kw: cache if cache is not None else DynamicCache(), "use_cache": True}
        if keep_last and self._keep_last:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, **kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[:, -1].float(), new_cache

    def _prefill_chunk(self, prompts: list[list[int]]) -> tuple[KVBatch, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=self.device)
        allowed = (causal[None] & mask[:, None, :]) | eye[None]  # [U, q, k]
        logits, cache = self._forward(ids, self._additive(allowed[:, None]), pos, None, keep_last=True)
        if self.taps is not None:  # routed [U * width] tokens, left padding dropped
            shape = self.taps.shape
            routes = self.taps.take().view(len(prompts), width, shape.layers, shape.top_k)
            self.last_routes = [routes[i, width - len(p):] for i, p in enumerate(prompts)]
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        return KVBatch(cache, mask, lens, torch.zeros_like(lens)), logits

    def prefill(self, prompts: list[list[int]]) -> tuple[KVBatch, torch.Tensor]:
        """Prefill prompts in chunks of at most ``prefill_token_budget`` padded tokens."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        # Chunks of similar length waste less padding; rows are put back in order at the end.
        chunks, cur = [], []
        for i in order:
            if cur and (len(cur) + 1) * len(prompts[i]) > self.prefill_token_budget:
                chunks.append(cur)
                cur = []
            cur.append(i)
        chunks.append(cur)
        batch, logits, routes = None, [], [None] * len(prompts)
        for chunk in chunks:
            part, part_logits = self._prefill_chunk([prompts[i] for i in chunk])
            batch = part if batch is None else self.merge(batch, part)
            logits.append(part_logits)
            if self.taps is not None:
                for i, r in zip(chunk, self.last_routes, strict=True):
                    routes[i] = r
        if self.taps is not None:
            self.last_routes = routes
        if len(chunks) > 1 or order != list(range(len(prompts))):
            back = torch.empty(len(prompts), dtype=torch.long)
            back[torch.tensor(order)] = torch.arange(len(prompts))
            back = back.to(self.device)
            return self.select(batch, back), torch.cat(logits)[back]
        return batch, logits[0]

    def decode(self, batch: KVBatch) -> torch.Tensor:
        ones = torch.ones(batch.size, 1, dtype=torch.bool, device=self.device)
        mask = torch.cat([batch.mask, ones], dim=1)
        logits, batch.cache = self._forward(batch.last_tok[:, None], self._additive(mask[:, None, None, :]),
                                            batch.next_pos[:, None], batch.cache, keep_last=False)
        if self.taps is not None:
            self.last_routes = self.taps.take()
        batch.mask = mask
        batch.next_pos = batch.next_pos + 1
        return logits

    # ----- row bookkeeping ------------------------------------------------------
    def select(self, batch: KVBatch, rows: torch.Tensor) -> KVBatch:
        """Keep (or repeat) ``rows`` of the batch, then trim columns that are padding everywhere."""
        rows = rows.to(self.device)
        mask = batch.mask.index_select(0, rows)
        real = mask.any(dim=0)
        start = int(real.to(torch.int8).argmax()) if bool(real.any()) else mask.shape[1]
        for layer in _layers(batch.cache):
            layer.keys = layer.keys.index_select(0, rows)[:, :, start:]
            layer.values = layer.values.index_select(0, rows)[:, :, start:]
        return KVBatch(batch.cache, mask[:, start:], batch.next_pos.index_select(0, rows),
                       batch.last_tok.index_select(0, rows))

    def merge(self, a: KVBatch, b: KVBatch) -> KVBatch:
        """Rows of ``a`` then rows of ``b``; the shorter one is left-padded to the common length."""
        width = max(a.mask.shape[1], b.mask.shape[1])

        def pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            if missing == 0:
                return t
            spec = [0, 0] * (dim_from_end - 1) + [missing, 0]
            return torch.nn.functional.pad(t, spec)

        for la, lb in zip(_layers(a.cache), _layers(b.cache), strict=True):
            la.keys = torch.cat([pad(la.keys, 2), pad(lb.keys, 2)])
            la.values = torch.cat([pad(la.values, 2), pad(lb.values, 2)])
        return KVBatch(a.cache, torch.cat([pad(a.mask, 1), pad(b.mask, 1)]),
                       torch.cat([a.next_pos, b.next_pos]), torch.cat([a.last_tok, b.last_tok]))
