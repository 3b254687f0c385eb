"""Triton versions of the fast runner's fused operations (GPU path).

Contract: the same four functions and results (up to rounding) as ``kernels/torch_ops.py``,
which states what each computes; the functions here say where they differ (``add_rmsnorm``
updates ``residual`` in place; ``decode_attention`` is a paged flash-decoding kernel whose CUDA
graphs stay valid for any context lengths). ``sample_plain`` is ``sampling.sample``'s fused form.

Importing this module imports triton; the runner imports it only on CUDA. It
knows nothing of layers, requests or CUDA graphs.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from conveyor.rollout.native.kernels.torch_ops import rmsnorm  # noqa: F401  (Qwen3 q/k norms: small, left to torch)

_LOG2E = 1.4426950408889634


@triton.jit
def _add_rmsnorm_kernel(X, R, W, OUT, stride_x, stride_r, stride_o, N, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=m, other=0.0)
        # Rounded to the storage dtype before the statistics, as the unfused add does.
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(R + row * stride_r + cols, h, mask=m)
    else:
        h = x
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / N
    normed = (hf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(W + cols, mask=m, other=0.0)
    tl.store(OUT + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=m)


def add_rmsnorm(x, residual, weight, eps):
    """``add_rmsnorm`` updates ``residual`` in place (the torch version returns a new
    tensor); callers use the returned residual either way.
    """
    t, n = x.shape
    out = torch.empty_like(x)
    res = x if residual is None else residual
    _add_rmsnorm_kernel[(t,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
                              HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=4)
    return out, res


@triton.jit
def _rope_store_kernel(QKV, POS, SLOTS, COS, SIN, QOUT, KC, VC, stride_t, stride_qt, stride_cs, stride_ch,
                       stride_cos, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HP: tl.constexpr):
    t = tl.program_id(0)
    half: tl.constexpr = D // 2
    h = tl.arange(0, HP)[:, None]  # 0..NQ-1 query heads, then NQ..NQ+NKV-1 key heads, then padding
    d = tl.arange(0, D)[None, :]
    live = h < NQ + NKV
    pos = tl.load(POS + t).to(tl.int64)
    c = tl.load(COS + pos * stride_cos + d)
    s = tl.load(SIN + pos * stride_cos + d)
    rot = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    base = QKV + t * stride_t + h * D
    x = tl.load(base + d, mask=live, other=0.0).to(tl.float32)
    xr = tl.load(base + rot, mask=live, other=0.0).to(tl.float32)
    y = (x * c + sign * xr * s).to(QOUT.dtype.element_ty)
    tl.store(QOUT + t * stride_qt + h * D + d, y, mask=h < NQ)
    slot = tl.load(SLOTS + t).to(tl.int64)
    kh = h - NQ
    is_k = (h >= NQ) & live
    tl.store(KC + slot * stride_cs + kh * stride_ch + d, y, mask=is_k)
    v = tl.load(QKV + t * stride_t + (NQ + NKV + kh) * D + d, mask=is_k, other=0.0)
    tl.store(VC + slot * stride_cs + kh * stride_ch + d, v, mask=is_k)


def rope_store(qkv, pos, slots, cos, sin, k_cache, v_cache, nq, nkv):
    """``rope_store`` runs one program per token over all its heads."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    q = torch.empty(t, nq, d, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(t,)](qkv, pos, slots, cos, sin, q, k_cache, v_cache, qkv.stride(0), q.stride(0),
                             k_cache.stride(0), k_cache.stride(1), cos.stride(0), NQ=nq, NKV=nkv, D=d,
                             HP=triton.next_power_of_2(nq + nkv), num_warps=4)
    return q


@triton.jit
def _decode_attn_kernel(Q, KC, VC, BT, CTX, OUT, WO, WL, qk_scale,
                        stride_qb, stride_qh, stride_cs, stride_ch, stride_bt, stride_ob, stride_oh,
                        stride_wob, stride_woh, stride_wos, stride_wlb, stride_wlh,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                        BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, LANES: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    lane = tl.program_id(2)  # reads chunks lane, lane + LANES, lane + 2 LANES, ... of the context
    ctx = tl.load(CTX + b)
    rest = ctx - lane * CHUNK
    if rest > 0:
        TILES: tl.constexpr = CHUNK // BLOCK_N  # tiles per chunk
        laps = rest // (LANES * CHUNK)
        last = tl.minimum(rest - laps * LANES * CHUNK, CHUNK)
        n_tiles = laps * TILES + tl.cdiv(last, BLOCK_N)  # every tile holds a token of the context
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < G
        heads = kh * G + g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for j in range(0, n_tiles):
            t = lane * CHUNK + (j // TILES) * (LANES * CHUNK) + (j % TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
            tm = t < ctx
            page = tl.load(BT + b * stride_bt + t // PS, mask=tm, other=0).to(tl.int64)
            off = (page * PS + t % PS)[:, None] * stride_cs + kh * stride_ch + d[None, :]
            k = tl.load(KC + off, mask=tm[:, None], other=0.0)
            v = tl.load(VC + off, mask=tm[:, None], other=0.0)  # issued with K so both loads are in flight
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(tm[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if ctx <= CHUNK:  # the whole context is this lane's one chunk: the final result
            tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=gm[:, None])
        else:
            tl.store(WO + b * stride_wob + heads[:, None] * stride_woh + lane * stride_wos + d[None, :],
                     acc / l_i[:, None], mask=gm[:, None])
            tl.store(WL + b * stride_wlb + heads * stride_wlh + lane, m_i + tl.log2(l_i), mask=gm)  # base 2


@triton.jit
def _merge_lanes_kernel(CTX, WO, WL, OUT, stride_wob, stride_woh, stride_wos, stride_wlb, stride_wlh,
                        stride_ob, stride_oh, NQ: tl.constexpr, HP: tl.constexpr, CHUNK: tl.constexpr,
                        LANES: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)  # one program per sequence, all its query heads
    ctx = tl.load(CTX + b)
    if ctx > CHUNK:
        hv = tl.arange(0, HP)
        h = hv[:, None]
        c = tl.arange(0, LANES)[None, :]
        live = (h < NQ) & (c < tl.cdiv(ctx, CHUNK))  # the lanes that read a chunk
        lse = tl.load(WL + b * stride_wlb + h * stride_wlh + c, mask=live, other=float("-inf"))  # [HP, LANES]
        top = tl.max(lse, axis=1)  # lane 0 always holds a token, so the max is finite for a real head
        w = tl.exp2(lse - tl.where(hv < NQ, top, 0.0)[:, None])
        w = w / tl.maximum(tl.sum(w, axis=1), 1e-30)[:, None]
        d = tl.arange(0, D)[None, None, :]
        o = tl.load(WO + b * stride_wob + h[:, :, None] * stride_woh + c[:, :, None] * stride_wos + d,
                    mask=live[:, :, None], other=0.0)  # [HP, LANES, D]
        out = tl.sum(o * w[:, :, None], axis=1)  # [HP, D]
        tl.store(OUT + b * stride_ob + h * stride_oh + tl.arange(0, D)[None, :], out.to(OUT.dtype.element_ty),
                 mask=h < NQ)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Decode-attention launch settings; benchmarks/engine_gpu.py --tune-attn measures the alternatives.
# head_dim -> (tokens per tile, warps, pipeline stages)
ATTN_CONFIG = {64: (64, 4, 2), 128: (64, 4, 3)}
# (programs per sequence and KV head, context tokens per chunk): many short chunks while the
# pairs alone leave multiprocessors idle, else fewer, longer ones.
SMALL_BATCH_SPLIT, LARGE_BATCH_SPLIT = (16, 128), (8, 256)


def small_batch(batch: int, kv_heads: int, device) -> bool:
    """Whether the (sequence, KV head) pairs alone are fewer than the multiprocessors."""
    return batch * kv_heads < _num_sms(device)


def attention_split(batch: int, kv_heads: int, device) -> tuple[int, int]:
    """(lanes, chunk tokens) of the decode attention for this batch (fixed per batch size, so a
    captured graph serves any context lengths)."""
    return SMALL_BATCH_SPLIT if small_batch(batch, kv_heads, device) else LARGE_BATCH_SPLIT


def decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, scale, block_size, max_ctx=None):
    """``decode_attention`` is a paged, grouped-query flash-decoding kernel. The
    context is cut into chunks of a fixed size dealt round-robin to ``lanes``
    programs per (sequence, KV head); each loads a KV tile once for all the query
    heads that share it, with an online softmax in float32, and a second kernel
    merges the lanes' results by their log-sum-exp (a context of one chunk is
    finished by its lane directly). Fixed chunks keep a heavy tail of long
    sequences from holding the kernel up: with one program per sequence, the
    kernel lasts as long as the longest one. Lanes and chunk size depend only on
    the batch size (``attention_split``), so a CUDA graph captured for a batch
    bucket stays valid for any context lengths. ``max_ctx`` is ignored.
    """
    b, nq, d = q.shape
    nkv = k_cache.shape[1]
    g = nq // nkv
    lanes, chunk = attention_split(b, nkv, q.device)
    block_n, warps, stages = ATTN_CONFIG.get(d, (64 if d <= 64 else 32, 4, 2))
    block_n = min(block_n, chunk)
    if chunk & (chunk - 1):
        raise ValueError(f"decode attention: a chunk of {chunk} tokens is not a power of two")
    out = torch.empty(b, nq, d, dtype=q.dtype, device=q.device)
    wo = torch.empty(b, nq, lanes, d, dtype=torch.float32, device=q.device)
    wl = torch.empty(b, nq, lanes, dtype=torch.float32, device=q.device)
    _decode_attn_kernel[(b, nkv, lanes)](
        q, k_cache, v_cache, block_tables, ctx_lens, out, wo, wl, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), wo.stride(0), wo.stride(1), wo.stride(2), wl.stride(0), wl.stride(1),
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, PS=block_size, BLOCK_N=block_n, CHUNK=chunk, LANES=lanes,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages)
    _merge_lanes_kernel[(b,)](ctx_lens, wo, wl, out, wo.stride(0), wo.stride(1), wo.stride(2), wl.stride(0),
                              wl.stride(1), out.stride(0), out.stride(1), NQ=nq, HP=triton.next_power_of_2(nq),
                              CHUNK=chunk, LANES=lanes, D=d, num_warps=4)
    return out.view(b, nq * d)


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_g, stride_o, F, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    gate = tl.load(GU + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_g + F + cols, mask=m, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + row * stride_o + cols, y.to(OUT.dtype.element_ty), mask=m)


def silu_mul(gu):
    t, f = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(t, f, dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(f, block))](gu, out, gu.stride(0), out.stride(0), f, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _uniform(seed, idx):
    """Uniform numbers in (0, 1) from a 32-bit integer hash of (seed, index) (the "lowbias32" mixer).

    Cheaper than Philox per element; int64 arithmetic masked to 32 bits keeps the
    wrap-around of unsigned 32-bit products. The top 23 bits k give (k + 1/2) / 2**23, exact in
    float32 and never 1.0 (``sampling.uniforms`` says why that matters).
    """
    x = (idx.to(tl.int64) * 0x9E3779B9 + seed) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _sample_kernel(LOGITS, stride_l, V, EOS, eos_bias, temperature, SEED, TOK, LP,
                   N_EOS: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if GREEDY:
        seed = 0  # draws nothing: SEED is not read
    else:
        seed = tl.load(SEED + row).to(tl.int64)
    to_base2 = 1.4426950408889634 / temperature  # scores in base 2: exp2 / log2 are single instructions
    m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
    s_vec = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(LOGITS + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        for e in tl.static_range(N_EOS):
            x = tl.where(cols == tl.load(EOS + e), x + eos_bias, x)
        s = x * to_base2
        # Online log-sum-exp per lane; a lane that has seen only -inf keeps sum 0.
        m_new = tl.maximum(m_vec, s)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.math.exp2(m_vec - safe) + tl.math.exp2(s - safe)
        m_vec = m_new
        if GREEDY:
            key = s
        else:
            # Gumbel-max, argmax(s - log(-log U)), draws exactly from softmax(s); in base 2
            # the noise is -log2(-log2 U) up to a constant, which leaves the argmax unchanged.
            u = _uniform(seed, cols)
            key = s - tl.math.log2(-tl.math.log2(u))
        take = key > best
        best = tl.where(take, key, best)
        best_idx = tl.where(take, cols, best_idx)
    m = tl.max(m_vec, axis=0)
    lse2 = m + tl.math.log2(tl.sum(s_vec * tl.math.exp2(m_vec - m), axis=0))
    top = tl.max(best, axis=0)
    tok = tl.min(tl.where(best == top, best_idx, V), axis=0)  # the first index among ties, as argmax
    x_tok = tl.load(LOGITS + row * stride_l + tok).to(tl.float32)
    for e in tl.static_range(N_EOS):
        x_tok = tl.where(tok == tl.load(EOS + e), x_tok + eos_bias, x_tok)
    tl.store(TOK + row, tok.to(tl.int64))
    tl.store(LP + row, x_tok / temperature - lse2 * 0.6931471805599453)


def sample_plain(logits, *, temperature: float, eos_ids: torch.Tensor, eos_bias: float,
                 seeds: torch.Tensor | None = None):
    """``sampling.sample`` without top-k / top-p, fused into one pass over the logits.

    Same distribution, the same logprob (``log_softmax(logits / T)`` of the biased
    logits at the drawn token, float32) and the same random numbers: row b's
    Gumbel-max runs over the uniform numbers hashed from ``seeds[b]`` (a device
    tensor) and the vocabulary index, so the two samplers draw the same tokens but
    where float rounding breaks a near-tie differently.
    """
    b, v = logits.shape
    greedy = temperature == 0
    if not greedy and (seeds is None or len(seeds) != b):
        raise ValueError("sample_plain: temperature > 0 needs one seed per row")
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    n_eos = int(eos_ids.numel()) if eos_bias else 0
    _sample_kernel[(b,)](logits, logits.stride(0), v, eos_ids, float(eos_bias), 1.0 if greedy else float(temperature),
                         tokens if greedy else seeds,  # greedy: any int tensor, never read
                         tokens, logprobs, N_EOS=n_eos, GREEDY=greedy, BLOCK=2048, num_warps=8)
    return tokens, logprobs
