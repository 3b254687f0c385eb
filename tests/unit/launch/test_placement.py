"""Placement: which device each role gets and which weight transport serves each engine."""
import pytest

from conveyor.config import load_config
from conveyor.launch.placement import PlacementError, plan


def _cfg(*over):
    return load_config(None, list(over))


def test_one_trainer_one_engine_colocated_runs_in_process():
    assert plan(_cfg(), visible_gpus=0).sync == "inprocess"
    p = plan(_cfg(), visible_gpus=4)
    assert (p.trainer_devices, p.engine_devices, p.sync) == (["cuda:0"], ["cuda:0"], "inprocess")


def test_disaggregated_gpus_are_split_between_trainer_ranks_and_engines():
    p = plan(_cfg("launch.placement=disaggregated", "launch.trainer_ranks=2", "launch.engines=6"), visible_gpus=8)
    assert p.trainer_devices == ["cuda:0", "cuda:1"]
    assert p.engine_devices == [f"cuda:{k}" for k in range(2, 8)]
    assert p.sync == "broadcast"
    p = plan(_cfg("launch.placement=disaggregated", "launch.trainer_ranks=3", "launch.engines=1"), visible_gpus=4)
    assert p.engine_devices == ["cuda:3"] and len(p.trainer_devices) == 3


def test_colocated_ranks_share_their_gpu_with_one_engine_each():
    p = plan(_cfg("launch.trainer_ranks=4", "launch.engines=4"), visible_gpus=4)
    assert p.trainer_devices == p.engine_devices == [f"cuda:{k}" for k in range(4)]
    assert p.sync == "ipc"


def test_single_gpu_is_shared_by_every_role_with_ipc():
    p = plan(_cfg("launch.placement=disaggregated", "launch.engines=2"), visible_gpus=1)
    assert p.trainer_devices == ["cuda:0"] and p.engine_devices == ["cuda:0", "cuda:0"] and p.sync == "ipc"


def test_cpu_uses_shared_memory_or_gloo_broadcast_when_asked():
    assert plan(_cfg("launch.placement=disaggregated"), visible_gpus=0).sync == "shm"
    p = plan(_cfg("launch.placement=disaggregated", "launch.trainer_ranks=2", "launch.weight_sync=broadcast"),
             visible_gpus=0)
    assert (p.trainer_devices, p.engine_devices, p.sync) == (["cpu", "cpu"], ["cpu"], "broadcast")


@pytest.mark.parametrize("over, gpus, words", [
    (("launch.placement=disaggregated", "launch.trainer_ranks=2", "launch.engines=3"), 4,
     "needs launch.trainer_ranks + launch.engines = 2 + 3 = 5 GPUs but 4 are visible"),
    (("launch.trainer_ranks=3", "launch.engines=3"), 2, "needs 3 GPUs but 2 are visible"),
    (("launch.placement=disaggregated", "launch.weight_sync=ipc"), 0, "needs GPUs"),
    (("launch.placement=disaggregated", "launch.weight_sync=ipc"), 2, "does not fit this placement"),
])
def test_placements_that_do_not_fit_are_named(over, gpus, words):
    with pytest.raises(PlacementError, match=words.replace("+", r"\+")):
        plan(_cfg(*over), visible_gpus=gpus)


def test_colocated_ranks_and_engines_must_pair_up():
    with pytest.raises(ValueError, match="launch.engines .2. must equal launch.trainer_ranks .3."):
        _cfg("launch.trainer_ranks=3", "launch.engines=2")


def test_a_publishing_trainer_call_waits_past_a_regroup_that_names_who_did_not_join():
    # A publish may wait launch.collective_timeout_s for a replaced engine to join, then fail
    # naming it: the call's own deadline must not run out first (it would name only the trainer).
    from conveyor.launch.roles import TrainerProxy
    proxy = TrainerProxy([], timeout=300.0, collective_s=120.0)
    assert [proxy._deadline(m) for m in ("train_and_publish", "finish_and_publish", "publish")] == [540.0] * 3
    assert proxy._deadline("logprobs") == proxy._deadline("accumulate") == 300.0
