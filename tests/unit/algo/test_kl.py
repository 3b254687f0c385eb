"""KL estimators: values, gradients, unbiasedness, masking."""
import math

import pytest
import torch

from conveyor.algo import kl_estimate

LP = [-1.0, -2.0, -0.5]
REF = [-1.5, -1.0, -0.5]  # log_ratio = [0.5, -1.0, 0.0]


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


@pytest.mark.parametrize("kind,value,grad", [
    ("k1", [0.5, -1.0, 0.0], [1.0, 1.0, 1.0]),
    ("k2", [0.125, 0.5, 0.0], [0.5, -1.0, 0.0]),
    # k3 = e^{-x} - 1 + x, d/dx = 1 - e^{-x}
    ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0], [1 - math.exp(-0.5), 1 - math.e, 0.0]),
])
def test_values_and_gradient(kind, value, grad):
    lp = torch.tensor([LP], requires_grad=True)
    ref = torch.tensor([REF], requires_grad=True)
    kl = kl_estimate(lp, ref, kind)
    close(kl, [value])
    kl.sum().backward()
    close(lp.grad, [grad])
    assert ref.grad is None  # the reference is frozen


def test_k1_and_k3_are_unbiased_under_the_policy():
    # E_p[k] over a 3-token vocabulary equals KL(p || q) = 0.7 ln 1.75 + 0.3 ln 0.5
    p, q = torch.tensor([[0.7, 0.2, 0.1]]), torch.tensor([[0.4, 0.4, 0.2]])
    exact = 0.7 * math.log(1.75) + 0.3 * math.log(0.5)
    for kind in ("k1", "k3"):
        est = (p * kl_estimate(p.log(), q.log(), kind)).sum()
        assert est.item() == pytest.approx(exact, abs=1e-6)


def test_mask_zeroes_garbage_without_nan():
    lp = torch.tensor([[-1.0, -float("inf")]], requires_grad=True)
    ref = torch.tensor([[-1.5, float("nan")]])
    kl = kl_estimate(lp, ref, "k3", mask=torch.tensor([[1, 0]]))
    close(kl, [[math.exp(-0.5) - 0.5, 0.0]])
    kl.sum().backward()
    close(lp.grad, [[1 - math.exp(-0.5), 0.0]])


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
