"""Devices and placements this machine cannot provide are refused before anything starts."""
import pytest

from conveyor.config import load_config
from conveyor.launch.preflight import DeviceError, check_devices


@pytest.mark.parametrize("gpus,overrides,needle", [
    (0, ["rollout.device=cuda"], "rollout.device=cuda but this machine has no usable CUDA GPU"),
    (0, ["trainer.device=cuda:0"], "trainer.device=cuda:0 but this machine has no usable CUDA GPU"),
    (0, ["launch.placement=disaggregated", "trainer.device=cuda"], "set trainer.device=auto or trainer.device=cpu"),
    (1, ["trainer.device=cuda:1"], "only 1 CUDA GPU(s) are visible"),
    (1, ["launch.placement=disaggregated", "launch.trainer_ranks=2"],
     "launch.placement=disaggregated needs launch.trainer_ranks + launch.engines = 2 + 1 = 3 GPUs but 1"),
    (2, ["launch.trainer_ranks=4", "launch.engines=4"], "launch.trainer_ranks=4 with placement=colocated needs 4"),
    (0, ["launch.placement=disaggregated", "launch.weight_sync=ipc"], "launch.weight_sync=ipc needs GPUs"),
])
def test_refused_in_one_line(gpus, overrides, needle):
    with pytest.raises(DeviceError) as e:
        check_devices(load_config(None, overrides), visible_gpus=gpus)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("gpus,overrides", [
    (0, []),
    (0, ["launch.placement=disaggregated", "launch.trainer_ranks=2"]),  # CPU processes, gloo
    (1, ["trainer.device=cuda", "rollout.device=cuda:0"]),
    (3, ["launch.placement=disaggregated", "launch.trainer_ranks=2"]),
    (1, ["launch.placement=disaggregated", "launch.trainer_ranks=2", "trainer.device=cpu"]),
])
def test_what_fits_passes(gpus, overrides):
    check_devices(load_config(None, overrides), visible_gpus=gpus)
