"""PolicyLoss wiring: with one optimizer step per batch the proximal policy is the training forward."""
import pytest
import torch

from conveyor.config import AlgoConfig
from conveyor.controller.objective import PolicyLoss, needs


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    lp = (-torch.rand(2, 5, generator=gen) * 2).requires_grad_()
    mb = {"loss_mask": mask, "advantages": torch.randn(2, 5, generator=gen) * mask,
          # a stale behaviour policy: some tokens far from the current one
          "behaviour_logprobs": (-torch.rand(2, 5, generator=gen) * 3) * mask}
    return lp, mb


@pytest.mark.parametrize("algo", [{"loss": "decoupled_ppo"}, {"importance_sampling": "truncated"},
                                  {"importance_sampling": "masked", "is_cap": 5.0}])
def test_one_update_uses_the_forward_as_proximal_and_matches_a_recompute(algo):
    cfg = AlgoConfig(**algo)
    assert needs(cfg).proximal and not needs(cfg, one_update=True).proximal
    lp1, mb = _inputs()
    loss1, m1 = PolicyLoss(cfg, one_update=True)({"logprobs": lp1}, mb, 6.0, 2)
    loss1.backward()
    # The recompute path, given exactly what a recompute of the same weights returns.
    lp2, _ = _inputs()
    mb2 = dict(mb, proximal_logprobs=lp2.detach().clone())
    loss2, m2 = PolicyLoss(cfg)({"logprobs": lp2}, mb2, 6.0, 2)
    loss2.backward()
    assert float(loss1) == pytest.approx(float(loss2), abs=1e-7) and float(loss1) != 0.0
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=0, atol=1e-7)
    assert m1.keys() == m2.keys()
    # And it differs from ignoring staleness (old = behaviour): the correction is really applied.
    lp3, _ = _inputs()
    loss3, _ = PolicyLoss(AlgoConfig())({"logprobs": lp3}, mb, 6.0, 2)
    assert abs(float(loss3) - float(loss1)) > 1e-4
