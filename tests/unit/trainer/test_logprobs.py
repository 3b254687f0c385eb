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


KERNEL_CHECK = r"""
import torch
from conveyor.trainer.logprobs import token_logprobs
g = torch.Generator().manual_seed(0)
vocab = 9000  # three kernel blocks, the last one partly outside the vocabulary
for dtype, temperature in ((torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7)):
    base = (torch.randn(3, 5, vocab, generator=g) * 4).to(dtype)
    base[0, 1, 17] = 60.0  # one dominant logit: the online maximum must rescale the running sum
    ids = torch.randint(0, vocab, (3, 5), generator=g)
    ids[0, 2] = 17
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 3:] = 0
    w = torch.randn(3, 5, generator=g)
    got, want = base.clone().requires_grad_(True), base.double().requires_grad_(True)
    out, _ = token_logprobs(got, ids, mask, temperature, kernel=True)
    ref = torch.log_softmax(want[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref = torch.nn.functional.pad(ref * mask[:, 1:], (1, 0))  # float64 throughout
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
    assert out[1, 3:].eq(0).all() and out[:, 0].eq(0).all()
    (out * w).sum().backward()
    (ref * w.double()).sum().backward()
    assert got.grad.dtype == dtype and got.grad[1, 3:].eq(0).all() and got.grad[:, -1].eq(0).all()
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.grad.double(), want.grad, rtol=0.01 if tol > 1e-6 else 0, atol=tol)
print("kernel ok")
"""


def test_triton_kernel_matches_the_plain_form_in_the_interpreter(interpreted):
    """The GPU kernels, run by Triton's CPU interpreter: values and gradients of float32 and bf16
    logits against a float64 reference, skipped rows (padding, last position) exactly 0."""
    assert "kernel ok" in interpreted(KERNEL_CHECK, timeout=300)


def test_negative_targets_are_skipped_by_the_torch_form():
    logits, ids, mask = _inputs(torch.float32)
    out, _ = token_logprobs(logits, ids, mask, chunk_rows=4, kernel=False)
    (out.sum()).backward()
    assert logits.grad[2, 1:].eq(0).all() and logits.grad[:, -1].eq(0).all()
    assert logits.grad[0, :-1].abs().sum() > 0


def test_a_cpu_chunk_is_held_to_the_cache_budget_and_changes_nothing(monkeypatch):
    from conveyor.trainer import logprobs
    assert logprobs.cpu_chunk(1024, 49152) == 16 and logprobs.cpu_chunk(1024, 151936) == 5
    assert logprobs.cpu_chunk(4, 10) == 4 and logprobs.cpu_chunk(1024, 10 ** 9) == 1
    la, ids, mask = _inputs(torch.float32)
    plain, _ = token_logprobs(la, ids, mask, 0.7, chunk_rows=None)
    monkeypatch.setattr(logprobs, "CPU_CHUNK_BYTES", 3 * 4 * 50)  # three rows of the 50 ids
    reductions = []
    logsumexp = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda x, dim: reductions.append(x.shape[0]) or logsumexp(x, dim))
    lb = la.detach().clone().requires_grad_(True)
    chunked, _ = token_logprobs(lb, ids, mask, 0.7, chunk_rows=1024, kernel=False)
    assert reductions == [3] * 7  # 21 positions, three at a time
    torch.testing.assert_close(chunked, plain, rtol=0, atol=1e-6)
    w = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    (plain * w).sum().backward()
    (chunked * w).sum().backward()
    torch.testing.assert_close(lb.grad, la.grad, rtol=0, atol=1e-6)
