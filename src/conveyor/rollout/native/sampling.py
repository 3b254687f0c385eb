"""Token sampling and behaviour logprobs from one step's logits, with a random stream per request.

- ``sample(logits, ..., seeds)``: tokens and float32 logprobs; the logprob is the trainer's
  formula over the temperature-scaled distribution BEFORE top-k / top-p truncation.
- Randomness is keyed, not drawn from a shared generator (``request_key``, ``draw_seeds``): a
  request's tokens depend on its key, the weights and its own prefix only, never on which other
  requests share the batch.
- The hash is the one of ``triton_ops.sample_plain`` (the GPU's fused sampler), so both draw
  the same tokens up to float rounding at near-ties.

It does not know about requests, stop conditions or the model: one call, one
batch of logits.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF
_LOG2E = 1.4426950408889634
# Row blocks of the reference sampler's noise: bounds its temporaries on a large vocabulary.
_NOISE_ELEMS = 1 << 20
# The Gumbel noise -log2(-log2 u) of a uniform u in [2**-24, 1 - 2**-24] lies in
# [-log2(24), 24 - log2(log2 e)] = [-4.585, 23.471]: 28.06 wide, rounded up for float32.
_NOISE_SPAN = 29.0
# splitmix64: the golden-ratio increment and the finaliser's two multipliers (as Python ints
# for request keys, as uint64 for the per-step seeds on numpy arrays).
_GOLDEN, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_NP_GOLDEN, _NP_C1, _NP_C2 = np.uint64(_GOLDEN), np.uint64(_C1), np.uint64(_C2)
_S27, _S30, _S31, _S33 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(33)


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def request_key(seed: int, prompt: int, sample: int) -> int:
    """The 64-bit key of the random stream of sample ``sample`` of prompt ``prompt`` in a call seeded ``seed``.

    Randomness is keyed, not drawn from a shared generator: row b's draw is a
    Gumbel-max over uniform numbers hashed from ``seeds[b]`` and the vocabulary
    index, and the engines give each row the seed ``draw_seeds(key, k)`` of its
    request's stream ``key`` and the index ``k`` of the token being drawn. So a
    request's tokens depend on its key, the weights and its own prefix only: not on
    which other requests share the batch, on the batch size, on preemption, or on
    whether the loop reads a step before queueing the next. ``request_key(seed,
    prompt, sample)`` makes a call's keys; prompt ``i`` of a call seeded ``s`` gets
    the keys of prompt 0 of a call seeded ``s + i``, so a caller that seeds each
    chunk with ``base + (its first prompt's place in a schedule)`` gives every
    prompt a key of its own place, however the schedule is cut into calls.
    """
    return _mix64((_mix64((int(seed) + int(prompt)) & _M64) + _GOLDEN * (int(sample) + 1)) & _M64)


def draw_seeds(keys, index) -> np.ndarray:
    """Per-row 31-bit seeds of one draw: row b draws token ``index[b]`` of the stream ``keys[b]``."""
    # splitmix64 of key + index * golden ratio, in place (this runs on the host every step).
    z = np.array(index, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z *= _NP_GOLDEN
        z += np.array(keys, dtype=np.uint64)
        z ^= z >> _S30
        z *= _NP_C1
        z ^= z >> _S27
        z *= _NP_C2
        z ^= z >> _S31
    z >>= _S33
    return z.view(np.int64)


def _int32(x: torch.Tensor | int):
    """The low 32 bits of an integer (tensor) as a signed 32-bit value (int32 for a tensor)."""
    if isinstance(x, int):
        return ((x & _M32) ^ (1 << 31)) - (1 << 31)
    return (((x.to(torch.int64) & _M32) ^ (1 << 31)) - (1 << 31)).to(torch.int32)


def uniforms(seeds: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1) for ``seeds`` and ``cols`` broadcast together: the "lowbias32"
    hash of (seed, column) that the fused GPU sampler computes (``triton_ops._uniform``), kept to
    its top 23 bits ``k`` as ``(k + 1/2) / 2**23``. Every such number is exact in float32 and lies
    in [2**-24, 1 - 2**-24]. (From 24 bits the largest, 1 - 2**-25, rounds to 1.0, whose noise is
    infinite: that column would win the draw whatever its probability, once in 2**24 columns.)"""
    return _lowbias32(_column_term(cols) + _int32(seeds))


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """``uniforms`` from the hash's first term ``cols * 0x9E3779B9 + seeds`` (int32, consumed).
    Computed in int32, whose products wrap modulo 2**32 as the hash's unsigned ones do; a
    logical right shift is the arithmetic one masked to the bits it keeps."""
    x ^= (x >> 16) & 0xFFFF
    x *= _int32(0x7FEB352D)
    x ^= (x >> 15) & 0x1FFFF
    x *= _int32(0x846CA68B)
    x ^= (x >> 16) & 0xFFFF
    x = (x >> 9) & 0x7FFFFF
    return (x.to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def _top_k_mask(scaled: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with the k-th survive)."""
    if k <= 0 or k >= scaled.shape[-1]:
        return scaled
    kth = torch.topk(scaled, k, dim=-1).values[:, -1:]
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _top_p_mask(scaled: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return scaled
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Probability mass strictly before each token: a token is dropped once the mass
    # before it already reaches p, so the most likely token is always kept.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def _column_term(cols: torch.Tensor) -> torch.Tensor:
    """The hash's first term, ``cols * 0x9E3779B9`` wrapped to int32."""
    return _int32(cols) * _int32(0x9E3779B9)


@functools.lru_cache(maxsize=8)
def _vocabulary_terms(v: int, device: str) -> torch.Tensor:
    """``_column_term`` of columns ``0..v-1``: the same for every row and step, so the dense draw
    computes it once per vocabulary size."""
    return _column_term(torch.arange(v, dtype=torch.int64, device=device))


def _gumbel_argmax(allowed: torch.Tensor, temperature: float, seeds: torch.Tensor) -> torch.Tensor:
    """argmax(logits / T - log(-log U)) per row: an exact draw from softmax(allowed logits / T).
    In base 2 as the fused sampler computes it (the same argmax, the same rounding).

    Noise is drawn only for the columns that can win: two columns' noises differ by less than
    ``_NOISE_SPAN``, so a column scored further below its row's best loses to it whatever both draw.
    After a little training most rows keep a few columns, and hashing the whole vocabulary was
    most of a CPU decode step; when most columns can win, every column is drawn in row blocks.
    The columns are picked on the logits themselves (a column's score is its logit times a positive
    constant, rounded, which keeps their order; a column more than ``_NOISE_SPAN`` + 1 scores below
    its row's best is left out), and whether to draw them one by one is judged from every 16th
    column: neither changes a draw, only which columns are hashed, and neither makes a pass over a
    ``[B, V]`` temporary beyond the one comparison."""
    b, v = allowed.shape
    # float32 division, as the kernel computes it
    to_base2 = (torch.tensor(_LOG2E, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
                ).to(allowed.device)
    seeds = seeds.to(device=allowed.device, dtype=torch.int64)
    top = allowed.amax(dim=-1, keepdim=True)
    if not bool(torch.isnan(top).any()):  # a NaN row has no best column: argmax over all of it
        live = allowed >= top - (_NOISE_SPAN + 1.0) / to_base2
        if int(live[:, ::16].sum()) * 64 <= b * v:  # about a quarter of the columns or fewer
            rows, cols = live.nonzero(as_tuple=True)
            keys = allowed[rows, cols] * to_base2 - torch.log2(-torch.log2(uniforms(seeds[rows], cols)))
            best = torch.full((b,), float("-inf"), device=allowed.device).scatter_reduce(0, rows, keys, "amax")
            # The first column among a row's ties, as argmax takes.
            tied = torch.where(keys == best[rows], cols, v)
            return torch.full((b,), v, device=allowed.device).scatter_reduce(0, rows, tied, "amin")
    terms = _vocabulary_terms(v, str(allowed.device))
    step = max(1, _NOISE_ELEMS // v)
    out = []
    for r in range(0, b, step):
        u = _lowbias32(terms + _int32(seeds[r:r + step, None]))
        out.append(torch.argmax(allowed[r:r + step] * to_base2 - torch.log2(-torch.log2(u)), dim=-1))
    return torch.cat(out)


def sample(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           eos_ids: tuple[int, ...] = (), eos_bias: float = 0.0,
           seeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row (row b from ``seeds[b]``); return the tokens and their float32 logprobs.

    Contract: ``sample(logits, ..., seeds)`` takes next-token logits ``[B, V]`` (any
    float dtype) and returns ``(tokens [B] long, logprobs [B] float32)``. Everything
    is computed in float32. The logprob is ``log_softmax(logits / T)`` of the
    temperature-scaled distribution BEFORE top-k / top-p truncation, at the sampled
    token (``log_softmax(logits)`` for greedy), because the trainer recomputes
    exactly that, and with the trainer's formula (the token's scaled logit minus the
    row's logsumexp); truncation only decides which tokens may be drawn.
    ``eos_bias`` is added to the EOS logits first, so the logprob is of the biased
    distribution.
    """
    logits = logits.float()
    if eos_bias and eos_ids:
        logits = logits.clone()
        logits[:, list(eos_ids)] += eos_bias
    if temperature == 0:
        scaled = logits
        tokens = torch.argmax(logits, dim=-1)
    else:
        if seeds is None or len(seeds) != logits.shape[0]:
            raise ValueError("sample: temperature > 0 needs one seed per row (seeds=draw_seeds(keys, index))")
        scaled = logits if temperature == 1.0 else logits / temperature  # x / 1 is x
        # Truncation is decided on the tempered distribution; the draw scales the logits itself.
        kept = _top_p_mask(_top_k_mask(scaled, top_k), top_p)
        allowed = logits if kept is scaled else logits.masked_fill(kept == float("-inf"), float("-inf"))
        tokens = _gumbel_argmax(allowed, temperature, seeds)
    return tokens, token_logprob(scaled, tokens)


def token_logprob(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(scaled)[tokens]`` per row, as the picked logit minus the row's logsumexp: the
    trainer's formula (``trainer/logprobs.py``, the fused GPU sampler's too). torch's CPU
    ``log_softmax`` kernel is less exact in float32 (up to ~1e-5 off at |logits| ~ 40, measured
    against float64, and biased), which alone would put the engine's logprobs that far from the
    trainer's on the same logits."""
    picked = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)
