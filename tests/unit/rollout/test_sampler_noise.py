"""The keyed sampler's noise: the hash it draws, its range, and the columns it may skip."""
import math

import pytest
import torch

from conveyor.rollout.native import sampling
from conveyor.rollout.native.sampling import _gumbel_argmax, uniforms

M32 = 0xFFFFFFFF


def lowbias32_spec(seeds: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The hash as unsigned 32-bit arithmetic, in int64 that never overflows, then its top 23 bits."""
    x = (cols[None, :] * 0x9E3779B9 + seeds[:, None]) & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0xA68B + (((x * 0x846C) & 0xFFFF) << 16)) & M32  # x * 0x846CA68B mod 2**32
    x = x ^ (x >> 16)
    return ((x >> 9).to(torch.float32) + 0.5) / 2.0 ** 23


def test_uniforms_are_the_unsigned_hash_and_strictly_inside_0_1():
    gen = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(0, 2 ** 31, (40,), generator=gen),
                       torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 31, M32, 2 ** 40 + 5])])
    cols = torch.cat([torch.arange(60_000), torch.tensor([2 ** 31 - 1, M32])])
    u = uniforms(seeds[:, None], cols[None, :])
    assert torch.equal(u, lowbias32_spec(seeds, cols))
    # Pairs drawn one by one (the sampler's sparse path) are the same numbers.
    rows = torch.randint(0, len(seeds), (5000,), generator=gen)
    picked = torch.randint(0, len(cols), (5000,), generator=gen)
    assert torch.equal(uniforms(seeds[rows], cols[picked]), u[rows, picked])
    # Every value k + 1/2 over 2**23 is exact in float32: never 0, never 1, so the noise is finite.
    k = torch.arange(2 ** 23, dtype=torch.float32)
    edge = (k + 0.5) / 2.0 ** 23
    assert float(edge.min()) == 2.0 ** -24 and float(edge.max()) == 1 - 2.0 ** -24
    noise = -torch.log2(-torch.log2(edge))
    assert bool(torch.isfinite(noise).all())
    # The sampler's span covers the whole range of the noise.
    assert float(noise.max() - noise.min()) < sampling._NOISE_SPAN
    assert math.isclose(float(noise.max()), 24 - math.log2(math.log2(math.e)), abs_tol=1e-3)
    assert math.isclose(float(noise.min()), -math.log2(24), abs_tol=1e-4)


def test_a_token_of_negligible_probability_is_never_drawn():
    # Token 0 has all the mass; each other token has e**-30 of it (4.6e-9 in all on 49,152
    # columns). When the largest uniform rounded to 1.0, its column's noise was infinite and
    # about one draw in 300 on this vocabulary took a random token.
    rows, vocab = 3000, 49_152
    logits = torch.full((rows, vocab), -30.0)
    logits[:, 0] = 0.0
    seeds = torch.arange(rows, dtype=torch.int64) * 7919
    for temperature in (1.0, 0.7):
        drawn = _gumbel_argmax(logits, temperature, seeds)
        assert int((drawn != 0).sum()) == 0


@pytest.mark.parametrize("spread", [0.5, 4.0, 15.0, 60.0])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_drawing_only_the_columns_that_can_win_draws_the_same_tokens(spread, temperature, monkeypatch):
    gen = torch.Generator().manual_seed(int(spread * 10))
    rows, vocab = 64, 5000
    logits = torch.randn(rows, vocab, generator=gen) * spread
    logits[:8, 100:4000] = float("-inf")  # rows truncated by top-k / top-p
    logits[8:12, 10] = logits[8:12, 20] = logits[8:12].amax(-1) + 50.0  # two equal best columns
    seeds = torch.randint(0, 2 ** 31, (rows,), generator=gen)
    pruned = _gumbel_argmax(logits, temperature, seeds)
    monkeypatch.setattr(sampling, "_NOISE_SPAN", float("inf"))  # every column drawn
    every = _gumbel_argmax(logits, temperature, seeds)
    assert torch.equal(pruned, every)
    assert bool((logits.gather(1, pruned[:, None]) > float("-inf")).all())
    assert set(pruned[8:12].tolist()) <= {10, 20}


def test_pruned_draws_follow_the_distribution():
    # A peaked distribution (the pruned path): frequencies within 4 standard errors.
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05] + [1e-20] * 996)
    rows = 8000
    logits = torch.log(probs).repeat(rows, 1)
    drawn = _gumbel_argmax(logits, 1.0, torch.arange(rows, dtype=torch.int64) * 104729 + 3)
    freq = torch.bincount(drawn, minlength=4)[:4].float() / rows
    tol = 4 * torch.sqrt(probs[:4] * (1 - probs[:4]) / rows)
    assert bool(((freq - probs[:4]).abs() < tol).all()), freq
    assert int((drawn >= 4).sum()) == 0


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_dense_draw_in_row_blocks_is_the_hash_of_every_column(temperature, monkeypatch):
    # Most columns can win: every column is drawn, a few rows at a time (the last block short),
    # with the hash's column term computed once; the draw is the argmax of the spec's noise.
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 37, 3001
    logits = torch.randn(rows, vocab, generator=gen) * 3.0
    seeds = torch.randint(0, 2 ** 31, (rows,), generator=gen)
    monkeypatch.setattr(sampling, "_NOISE_ELEMS", vocab * 5)
    drawn = _gumbel_argmax(logits, temperature, seeds)
    to_base2 = torch.tensor(sampling._LOG2E, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    noise = -torch.log2(-torch.log2(lowbias32_spec(seeds, torch.arange(vocab))))
    assert torch.equal(drawn, torch.argmax(logits * to_base2 + noise, dim=-1))
    # A row with a NaN logit draws the NaN's column, as argmax does; the other rows are unchanged.
    logits[3, 7] = float("nan")
    with_nan = _gumbel_argmax(logits, temperature, seeds)
    assert int(with_nan[3]) == 7
    assert torch.equal(with_nan[torch.arange(rows) != 3], drawn[torch.arange(rows) != 3])
