"""The chunked logprob head equals the plain autograd form in values and gradients."""
import pytest
import torch

from conveyor.trainer.logprobs import token_logprobs


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).to(dtype).requires_grad_(True)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0  # right padding
    mask[2, 2:] = 0
    return logits, ids, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 1024])
def test_chunked_matches_plain_in_float32(temperature, chunk):
    la, ids, mask = _inputs(torch.float32)
    lb = la.detach().clone().requires_grad_(True)
    plain, _ = token_logprobs(la, ids, mask, temperature, chunk_rows=None)
    chunked, _ = token_logprobs(lb, ids, mask, temperature, chunk_rows=chunk)
    torch.testing.assert_close(chunked, plain, rtol=0, atol=1e-6)
    assert (chunked[:, 0] == 0).all() and (chunked[1, 5:] == 0).all() and (chunked[2, 2:] == 0).all()
    w = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))  # a loss with mixed signs
    (plain * w).sum().backward()
    (chunked * w).sum().backward()
    torch.testing.assert_close(lb.grad, la.grad, rtol=0, atol=1e-6)
    assert la.grad.abs().sum() > 0


def test_chunked_bf16_keeps_the_logits_dtype_and_matches_a_float64_reference():
    lb, ids, mask = _inputs(torch.bfloat16)
    ref = lb.detach().double().requires_grad_(True)
    out, _ = token_logprobs(lb, ids, mask, 0.7, chunk_rows=5)
    expect, _ = token_logprobs(ref, ids, mask, 0.7, chunk_rows=None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expect.double(), rtol=0, atol=1e-5)  # float32 math on bf16 inputs
    out.sum().backward()
    expect.sum().backward()
    assert lb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lb.grad.double(), ref.grad, rtol=0.01, atol=2e-3)  # bf16 rounding of the grad


def test_entropy_uses_the_plain_form():
    logits, ids, mask = _inputs(torch.float32)
    lp, ent = token_logprobs(logits, ids, mask, with_entropy=True)
    lp2, none = token_logprobs(logits, ids, mask)
    assert none is None and ent is not None
    torch.testing.assert_close(lp, lp2, rtol=0, atol=1e-6)
