"""Mixture-of-experts routing: record the experts a model's routers choose, and replay them.

Engine and trainer compute router scores with different rounding, so near-ties go different
ways; rollout routing replay makes the trainer use the experts the engine used, per token and
per layer.
- A router is the Hugging Face top-k router (``moe_shape`` / ``config_moe_shape`` say whether
  and how a model has them).
- ``RouterTaps.of(model)``: forward hooks on its routers that record (``start_recording`` /
  ``take``) and replay (``replay(routes)``) the chosen experts; gradients still reach the
  router through the gathered weights.
- ``replay_differs``, ``set_replay``, ``own_routes``: disagreement and one-call helpers.

It knows nothing of engines, trainers, batches or configs.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MoEShape:
    layers: int  # routers (MoE layers)
    top_k: int
    num_experts: int


def _is_router(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and isinstance(getattr(module, "top_k", None), int)
            and isinstance(getattr(module, "num_experts", None), int) and hasattr(module, "norm_topk_prob")
            and not isinstance(module, nn.Linear))


def routers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _is_router(m)]


def moe_shape(model: nn.Module) -> MoEShape | None:
    """A mixture-of-experts layer sends each token to the ``top_k`` experts its router scores
    highest. The engine (often bf16) and the trainer (float32 or bf16 autocast) compute those
    scores with different rounding, so near-ties go different ways: the trainer then computes a
    token's logprob through other experts than the ones that sampled it. Rollout routing replay
    makes the trainer use the experts the engine used, per token and per layer.

    A router is a module with ``weight`` ``[E, H]``, ``top_k``, ``num_experts``,
    ``norm_topk_prob`` whose forward takes ``[N, H]`` (or ``[..., H]``) hidden states and returns
    ``(router_logits [N, E], weights [N, k], indices [N, k])``: the Hugging Face top-k router
    (Qwen3-MoE's ``Qwen3MoeTopKRouter`` and the routers written like it). ``moe_shape(model)``
    is None for a model without one, else its ``MoEShape`` (routers in module order = layer order);
    ``config_moe_shape(config)`` the same from a Hugging Face config (Qwen3-MoE's fields).
    """
    found = routers(model)
    if not found:
        return None
    return MoEShape(len(found), found[0].top_k, found[0].num_experts)


def config_moe_shape(config) -> MoEShape | None:
    """The same from a Hugging Face config (no weights): None for a dense model."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    experts = int(getattr(text, "num_experts", 0) or 0)
    k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    if experts <= 0 or k <= 0:
        return None
    sparse = [i for i in range(text.num_hidden_layers) if i not in (getattr(text, "mlp_only_layers", None) or [])
              and (i + 1) % int(getattr(text, "decoder_sparse_step", 1) or 1) == 0]
    return MoEShape(len(sparse), k, experts) if sparse else None


_TAPS: weakref.WeakKeyDictionary[nn.Module, RouterTaps] = weakref.WeakKeyDictionary()


class RouterTaps:
    """The hooks on one model's routers.

    ``RouterTaps.of(model)`` (one per model, made on first use) puts a forward hook on each
    router and holds what it does:
    - ``start_recording()`` / ``take()``: the indices each router chose in the forwards since,
      ``[N, layers, k]`` (int64, on the model's device) concatenated over those forwards in the
      order the routers ran (one forward: ``N`` = its tokens, flattened as the router saw them).
    - ``replay(routes)``: from now on (until the next ``replay``), a forward over ``[B, T]``
      tokens uses ``routes[b, t, layer]`` (``[B, T, layers, k]``, int) as the experts of token
      ``(b, t)`` wherever that row holds no negative entry, and the router's own top-k where it
      does (positions the engine never fed, padding). The chosen experts are weighted by the
      router's softmax probabilities gathered at them, renormalised over the k when the router
      has ``norm_topk_prob`` (what the router itself computes for its own choice), so gradients
      reach the router through those weights. ``replay(None)`` restores the router's own choice.
      The setting outlives the forward on purpose: gradient checkpointing re-runs it in backward.
    """

    def __init__(self, model: nn.Module):
        found = routers(model)
        if not found:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router; routing replay and "
                             "expert recording need an MoE model (e.g. Qwen3-MoE)")
        self.shape = MoEShape(len(found), found[0].top_k, found[0].num_experts)
        self._recording: list[list[torch.Tensor]] | None = None
        self._routes: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None  # [replayed rows, rows whose own choice differed], on device
        # A deep copy of the model copies these hooks too; they then answer for their own routers only.
        self._mine = {id(r) for r in found}
        for layer, router in enumerate(found):
            router.register_forward_hook(self._hook(layer))

    @classmethod
    def of(cls, model: nn.Module) -> RouterTaps:
        taps = _TAPS.get(model)
        if taps is None:
            taps = _TAPS[model] = cls(model)
        return taps

    def start_recording(self) -> None:
        self._recording = [[] for _ in range(self.shape.layers)]

    def take(self) -> torch.Tensor:
        """Indices chosen since ``start_recording`` (or the last ``take``), ``[N, layers, k]``."""
        if self._recording is None:
            raise RuntimeError("RouterTaps.take: call start_recording() first")
        per_layer = [torch.cat(chunks) if chunks else torch.zeros(0, self.shape.top_k, dtype=torch.long)
                     for chunks in self._recording]
        self._recording = [[] for _ in range(self.shape.layers)]
        return torch.stack(per_layer, dim=1)

    def stop_recording(self) -> None:
        self._recording = None

    def replay(self, routes: torch.Tensor | None) -> None:
        if routes is not None:
            s = self.shape
            if routes.dim() != 4 or routes.shape[2:] != (s.layers, s.top_k):
                raise ValueError(f"routing replay: routes have shape {tuple(routes.shape)}, expected "
                                 f"[batch, tokens, {s.layers}, {s.top_k}] (MoE layers, experts per token)")
            # Checked where it costs no device sync (the trainer's micro-batches leave the host later).
            if routes.device.type == "cpu" and routes.numel() and int(routes.max()) >= s.num_experts:
                raise ValueError(f"routing replay: expert {int(routes.max())} recorded, but the model has "
                                 f"{s.num_experts}; the routes come from another model")
        self._routes = routes

    def _hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: tuple):
            if id(module) not in self._mine:
                return None
            if self._routes is not None:
                output = self._replayed(module, layer, output)
            if self._recording is not None:
                self._recording[layer].append(output[2].detach().reshape(-1, self.shape.top_k).long())
            return output
        return hook

    def _replayed(self, module: nn.Module, layer: int, output: tuple) -> tuple:
        logits, _, own = output
        recorded = self._routes[:, :, layer].reshape(-1, self.shape.top_k)
        if recorded.shape[0] != own.shape[0]:
            raise ValueError(f"routing replay: routes cover {recorded.shape[0]} tokens but the forward has "
                             f"{own.shape[0]}; give routes shaped like the forward's [batch, tokens]")
        recorded = recorded.to(own.device)
        use = (recorded >= 0).all(dim=-1, keepdim=True)
        chosen = torch.where(use, recorded, own)
        with torch.no_grad():  # summed on the device: read once per step, no sync per forward
            differs = (recorded.sort(-1).values != own.sort(-1).values).any(-1, keepdim=True) & use
            counts = torch.stack([use.sum(), differs.sum()])
            self._counts = counts if self._counts is None else self._counts + counts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(-1, chosen)
        if module.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen


def replay_differs(model: nn.Module) -> float | None:
    """The fraction of replayed (token, layer) routing decisions where the model's own router would
    have chosen other experts, over the forwards since the last call; None if nothing was replayed."""
    taps = _TAPS.get(model)
    if taps is None or taps._counts is None:
        return None
    replayed, differs = taps._counts.tolist()
    taps._counts = None
    return differs / replayed if replayed else None


def set_replay(model: nn.Module, routes: torch.Tensor | None) -> None:
    """``RouterTaps.of(model).replay(routes)``; None on a model never given routes is a no-op
    (so a dense model's forwards never touch this module)."""
    if routes is not None:
        RouterTaps.of(model).replay(routes)
    elif model in _TAPS:
        _TAPS[model].replay(None)


def own_routes(model: nn.Module, forward: Callable[[], object]) -> tuple[object, torch.Tensor]:
    """``forward()``'s result and the experts the model's own routers chose in it ``[N, layers, k]``."""
    taps = RouterTaps.of(model)
    saved = taps._routes
    taps.replay(None)
    taps.start_recording()
    try:
        out = forward()
        return out, taps.take()
    finally:
        taps.stop_recording()
        taps._routes = saved
