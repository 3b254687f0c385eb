"""Parts of a step confined to some of the GPU's SMs (``loop.accumulate_sms``, a CUDA green
context) train the same step as parts on the whole GPU: the same kernels run, on fewer SMs."""
import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.trainer import sm_share
from conveyor.trainer.single import LocalTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = [9, 4, 12, 6, 7, 3, 10, 5]


def _step(make_model, make_batch, loss, sms, seen):
    trainer = LocalTrainer(make_model(), TrainerConfig(device="cuda", lr=1e-4, micro_batch_tokens=4096,
                                                       autocast_bf16=False, param_dtype="float32"), 10)
    backward = trainer._backward

    def spy(*args, **kwargs):
        seen.append(torch.cuda.current_stream().cuda_stream)
        return backward(*args, **kwargs)
    trainer._backward = spy
    batch = make_batch(LENGTHS)
    for part in (batch.select([0, 1, 2]), batch.select([3, 4]), batch.select([5, 6, 7])):
        trainer.accumulate(part, loss, None, sms)
    metrics = trainer.train_accumulated()
    return trainer, metrics


def test_confined_parts_take_the_same_step(make_model, make_batch, pg_loss):
    from torch.cuda import green_contexts
    if not green_contexts.SUPPORTED:
        pytest.skip("this torch has no CUDA green contexts")
    pg_loss.normaliser = "tokens"
    default = torch.cuda.current_stream().cuda_stream
    whole_streams, part_streams = [], []
    whole, m1 = _step(make_model, make_batch, pg_loss, None, whole_streams)
    few = sm_share.total_sms() // 4
    parts, m2 = _step(make_model, make_batch, pg_loss, few, part_streams)
    assert set(whole_streams) == {default}
    assert default not in part_streams and len(set(part_streams)) == 1  # one green stream, reused
    assert torch.cuda.current_stream().cuda_stream == default  # and left after each part
    # Same kernels, same order, in float32: equal up to the rounding of atomics in the backward.
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    for a, b in zip(whole.model.state_dict().values(), parts.model.state_dict().values()):
        assert float((a - b).abs().max()) <= 5e-6  # 5% of the lr-1e-4 Adam step, as on CPU


def test_a_count_the_gpu_cannot_give_is_refused():
    n = sm_share.total_sms()
    with pytest.raises(ValueError, match=f"this GPU has {n} SMs"):
        sm_share.check(n)
    sm_share.check(n - 1)
