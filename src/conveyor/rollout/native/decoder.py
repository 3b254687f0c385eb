"""The fast runner's own forward for Llama-family decoders (Llama 3, Qwen2 / Qwen2.5, Qwen3).

- ``unsupported_reason(model)`` is None when ``PagedDecoder`` can run ``model``, else a sentence
  saying why not; the engine then keeps the Hugging Face runner.
- ``PagedDecoder(model, max_positions)`` shares every weight with the model (fused projections
  re-point the model's parameters at slices), so an in-place update is seen by the next forward
  and by captured CUDA graphs; ``forward(ids, pos, slots, kv, attend, ops)`` runs it over flat
  tokens. Optional 8-bit weights (``quant.py``) are refreshed by ``requantize``.

It knows nothing of requests, block allocation, sampling or CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from conveyor.rollout.native.quant import QuantWeight, linear

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
# Rope types whose tables depend on the position alone (dynamic NTK and LongRoPE
# rescale with the sequence length, which one precomputed table cannot follow).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def unsupported_reason(model) -> str | None:
    """``unsupported_reason(model)`` is None when ``PagedDecoder`` can run ``model``
    (a ``*ForCausalLM`` whose ``model_type`` is llama, qwen2 or qwen3, SiLU MLP,
    RMSNorm, full attention in every layer, a position-independent rotary
    embedding), else a sentence saying why not; the engine then keeps the Hugging
    Face runner.
    """
    cfg = _text_config(model.config)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no .model.layers / .lm_head (expected a *ForCausalLM)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if int(getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1 is not supported"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window layers are not supported"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE:
        return f"rope_type {rope_type!r} depends on the sequence length"
    if not hasattr(inner, "rotary_emb"):
        return "the model has no shared rotary embedding module"
    return None


@dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_w: torch.Tensor | QuantWeight  # a QuantWeight (o_w, gu_w, down_w too) with quantization on
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor | QuantWeight
    o_b: torch.Tensor | None
    gu_w: torch.Tensor | QuantWeight
    gu_b: torch.Tensor | None
    down_w: torch.Tensor | QuantWeight
    down_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _fuse(linears: list, attr: str) -> torch.Tensor | None:
    """Concatenate ``attr`` of the linears along dim 0 and re-point each at its slice."""
    params = [getattr(lin, attr) for lin in linears]
    if all(p is None for p in params):
        return None
    if any(p is None for p in params):
        raise ValueError(f"cannot fuse: only some projections have a {attr}")
    fused = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for p in params:
        n = p.shape[0]
        # The parameter keeps its identity and name; only its storage moves into the fused tensor.
        p.data = fused[start:start + n]
        start += n
    return fused


def _bias(lin) -> torch.Tensor | None:
    return None if lin.bias is None else lin.bias


class PagedDecoder:
    """Weights and forward of one supported decoder.

    - ``PagedDecoder(model, max_positions)`` reads the weights from the model's own
      modules and keeps references to them, so an in-place copy into the model's
      parameters (``update_weights``) is seen by the next forward and by captured
      CUDA graphs. The q / k / v projections and the gate / up projections are
      fused into one matrix each: the fused tensor is built once and the model's
      parameters are re-pointed at slices of it (``param.data = fused[a:b]``), so the
      model and the fast forward share one copy of every weight.
    - ``quantization`` ``"fp8"`` / ``"int8"`` (``quant.py``) turns the q/k/v, o, gate/up
      and down weights into ``QuantWeight``s that follow those engine-dtype tensors;
      ``requantize(params)`` refreshes the ones holding any of the given model
      parameters after an in-place update. Embeddings, norms and the LM head keep
      the engine dtype.
    - ``forward(ids, pos, slots, kv, attend, ops)`` runs the decoder over ``T``
      tokens given as flat ``[T]`` tensors: token ids, positions and the KV-cache
      slot each token's keys and values are written to. ``kv(i)`` returns layer
      ``i``'s flat key and value caches ``[S, nkv, D]``; ``attend(i, q)`` returns the
      attention output ``[T, nq * D]`` for the rotated queries ``[T, nq, D]`` (decode
      reads the paged cache, prefill runs causal attention per prompt). It returns
      the final-normed hidden states ``[T, H]``; ``logits(h)`` applies the LM head.
    - Rotary tables are computed once by the model's own rotary module (so Llama 3
      and YaRN scaling come for free) in float32 for positions ``< max_positions``.
    """

    def __init__(self, model, max_positions: int, quantization: str = "none"):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fast runner: {reason}")
        cfg = _text_config(model.config)
        inner = model.model
        attn0 = inner.layers[0].self_attn
        self.num_layers = len(inner.layers)
        self.nq = int(cfg.num_attention_heads)
        self.nkv = int(getattr(cfg, "num_key_value_heads", None) or self.nq)
        self.head_dim = int(getattr(attn0, "head_dim", None) or cfg.hidden_size // self.nq)
        self.scale = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        self.eps = float(inner.norm.variance_epsilon)
        self.hidden = int(cfg.hidden_size)
        self.vocab = int(cfg.vocab_size)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        if self.head_dim & (self.head_dim - 1):
            raise ValueError(f"fast runner: head_dim {self.head_dim} is not a power of two")
        with torch.no_grad():
            self.layers = [self._layer(layer) for layer in inner.layers]
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.lm_bias = getattr(model.lm_head, "bias", None)
        self.cos, self.sin = self._rope_tables(inner.rotary_emb, max_positions)
        self.quantization = quantization
        self._quant_of: dict[int, QuantWeight] = {}  # id(model parameter) -> the 8-bit weight following it
        if quantization != "none":
            self._quantize(inner, quantization)

    def _quantize(self, inner, kind: str) -> None:
        for layer, src in zip(self.layers, inner.layers):
            a, m = src.self_attn, src.mlp
            if not hasattr(m, "gate_proj"):
                raise ValueError(f"rollout.quantization={kind} quantises dense MLPs only, not {type(m).__name__}; "
                                 "set rollout.quantization=none")
            for attr, lins in (("qkv_w", (a.q_proj, a.k_proj, a.v_proj)), ("o_w", (a.o_proj,)),
                               ("gu_w", (m.gate_proj, m.up_proj)), ("down_w", (m.down_proj,))):
                qw = QuantWeight(getattr(layer, attr), kind)
                setattr(layer, attr, qw)
                self._quant_of.update({id(lin.weight): qw for lin in lins})

    @property
    def quant_weights(self) -> list[QuantWeight]:
        """The 8-bit weights (none without quantization), each once."""
        return list({id(qw): qw for qw in self._quant_of.values()}.values())

    def requantize(self, params) -> None:
        """Re-quantise the 8-bit weights that follow any of ``params`` (model parameters updated in place)."""
        todo = {id(qw): qw for p in params if (qw := self._quant_of.get(id(p))) is not None}
        for qw in todo.values():
            qw.requantize()

    def _layer(self, layer) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if float(norm.variance_epsilon) != self.eps:
                raise ValueError("fast runner: layers use different RMSNorm epsilons")
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return _Layer(
            in_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
            qkv_w=_fuse([a.q_proj, a.k_proj, a.v_proj], "weight"), qkv_b=_fuse([a.q_proj, a.k_proj, a.v_proj], "bias"),
            o_w=a.o_proj.weight, o_b=_bias(a.o_proj),
            gu_w=_fuse([m.gate_proj, m.up_proj], "weight"), gu_b=_fuse([m.gate_proj, m.up_proj], "bias"),
            down_w=m.down_proj.weight, down_b=_bias(m.down_proj),
            q_norm=None if qn is None else qn.weight, k_norm=None if kn is None else kn.weight)

    def _rope_tables(self, rotary, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(max_positions, device=self.device)[None]
        probe = torch.empty(0, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            cos, sin = rotary(probe, pos)
        return cos[0].float().contiguous(), sin[0].float().contiguous()

    def _qk_norm(self, qkv: torch.Tensor, layer: _Layer, ops) -> torch.Tensor:
        """Qwen3's per-head RMSNorm of queries and keys, applied before the rotary embedding."""
        t, d = qkv.shape[0], self.head_dim
        q = qkv[:, :self.nq * d].reshape(t, self.nq, d)
        k = qkv[:, self.nq * d:(self.nq + self.nkv) * d].reshape(t, self.nkv, d)
        v = qkv[:, (self.nq + self.nkv) * d:]
        q = ops.rmsnorm(q, layer.q_norm, self.eps).reshape(t, -1)
        k = ops.rmsnorm(k, layer.k_norm, self.eps).reshape(t, -1)
        return torch.cat([q, k, v], dim=1)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                attend: Callable[[int, torch.Tensor], torch.Tensor], ops) -> torch.Tensor:
        x = F.embedding(ids, self.embed)
        residual = None
        for i, layer in enumerate(self.layers):
            normed, residual = ops.add_rmsnorm(x, residual, layer.in_norm, self.eps)
            qkv = linear(normed, layer.qkv_w, layer.qkv_b)
            if layer.q_norm is not None:
                qkv = self._qk_norm(qkv, layer, ops)
            k_cache, v_cache = kv(i)
            q = ops.rope_store(qkv, pos, slots, self.cos, self.sin, k_cache, v_cache, self.nq, self.nkv)
            o = linear(attend(i, q), layer.o_w, layer.o_b)
            normed, residual = ops.add_rmsnorm(o, residual, layer.post_norm, self.eps)
            x = linear(ops.silu_mul(linear(normed, layer.gu_w, layer.gu_b)), layer.down_w, layer.down_b)
        out, _ = ops.add_rmsnorm(x, residual, self.final_norm, self.eps)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head, self.lm_bias)
