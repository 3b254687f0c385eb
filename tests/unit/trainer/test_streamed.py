"""train(publish=...): the last optimizer step runs group by group while the weights are published;
the result is bit-identical to a plain step, every tensor leaves after its own update, and a failed
publish still leaves a whole step."""
import time

import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.trainer import streamed
from conveyor.trainer.single import LocalTrainer

LENGTHS = [9, 4, 12, 6, 7, 3, 10, 5]


def cfg(**kw):
    return TrainerConfig(**{"device": "cpu", "lr": 1e-2, "micro_batch_tokens": 4096, **kw})


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def state(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture
def small_groups(monkeypatch):
    # The tiny model is ~0.4 MB: groups of 16 KiB make many, each a few tensors.
    monkeypatch.setattr(streamed, "STREAM_BYTES", 16 * 2**10)


@pytest.mark.parametrize("extra", [{}, {"param_dtype": "bfloat16"}, {"mini_batches": 2, "ppo_epochs": 2},
                                   pytest.param({"device": "cuda"}, marks=GPU)])
def test_streamed_step_is_bit_identical_and_publishes_updated_weights(make_model, make_batch, pg_loss,
                                                                      small_groups, extra):
    """On a GPU: fused AdamW, bf16 compute copies and the step's end marked by a CUDA event."""
    batch = make_batch(LENGTHS)
    plain = LocalTrainer(make_model(), cfg(**extra), total_steps=4)
    streaming = LocalTrainer(make_model(), cfg(**extra), total_steps=4)
    dtype = streaming._dtype if streaming._copies else None
    for step in range(2):
        seen = []

        def publish(named):
            for name, t in named:
                seen.append((name, t.clone()))
        m_plain = plain.train(batch, pg_loss)
        t0 = time.time()
        m_stream = streaming.train(batch, pg_loss, publish=publish, publish_dtype=dtype)
        t1 = time.time()
        assert {k: v for k, v in m_stream.items() if k != "time_s"} == \
               {k: v for k, v in m_plain.items() if k != "time_s"}
        a, b = state(plain), state(streaming)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if streaming._copies:
            assert all(torch.equal(c, m.to(c.dtype)) for c, m in streaming._copies)
        # What left is what named_weights() shows after the step, name for name, bit for bit.
        after = list(streaming.named_weights(dtype))
        assert [n for n, _ in seen] == [n for n, _ in after]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(seen, after))
        assert streaming.step == step + 1
        assert t0 < streaming.step_ended < t1  # on a GPU read off the device's clock
    assert len(streaming._plans[dtype].groups) > 3


def test_every_parameter_is_stepped_once_and_copies_follow_their_masters(make_model, small_groups):
    t = LocalTrainer(make_model(), cfg(param_dtype="bfloat16"), total_steps=1)
    for dtype in (torch.bfloat16, None):  # the compute copies, or the float32 masters
        plan = streamed.StreamPlan(list(t.named_weights(dtype)), t._copies, list(t.model.parameters()))
        stepped = [i for ids, _, _ in plan.groups for i in ids]
        assert sorted(stepped) == sorted(id(p) for p in t.model.parameters())  # each exactly once
        group_of = {i: k for k, (ids, _, _) in enumerate(plan.groups) for i in ids}
        refreshed = [(k, c, m) for k, (_, pairs, _) in enumerate(plan.groups) for c, m in pairs]
        assert sorted(id(c) for _, c, _ in refreshed) == sorted(id(c) for c, _ in t._copies)
        assert all(group_of[id(m)] <= k for k, _, m in refreshed)


def test_a_failed_publish_still_leaves_a_whole_step(make_model, make_batch, pg_loss, small_groups):
    batch = make_batch(LENGTHS)
    plain = LocalTrainer(make_model(), cfg(param_dtype="bfloat16"), total_steps=2)
    failing = LocalTrainer(make_model(), cfg(param_dtype="bfloat16"), total_steps=2)

    def publish(named):
        for k, _ in enumerate(named):
            if k == 3:
                raise RuntimeError("engine 0 stalled")
    plain.train(batch, pg_loss)
    with pytest.raises(RuntimeError, match="engine 0 stalled"):
        failing.train(batch, pg_loss, publish=publish, publish_dtype=torch.bfloat16)
    a, b = state(plain), state(failing)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(c, m.to(c.dtype)) for c, m in failing._copies)
    assert failing.step == 1  # the scheduler and step count moved with the weights
    failing.train(batch, pg_loss)  # and the next step runs normally
    plain.train(batch, pg_loss)
    a, b = state(plain), state(failing)
    assert all(torch.equal(a[k], b[k]) for k in a)
