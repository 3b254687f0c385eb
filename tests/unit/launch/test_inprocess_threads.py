"""The one process of an in-process run on a GPU keeps ``launch.trainer_threads`` torch threads: its
CPU work is the host side of GPU kernels, where a thread pool's wake-ups cost more than they save.
On CPU the trainer computes on those threads, so nothing is changed there; the warm start in the
controller beside CPU engine processes takes the cores they leave."""
import torch

from conveyor.config import load_config
from conveyor.launch import roles
from conveyor.launch.placement import Placement, Routes


def _start(monkeypatch, placement, overrides):
    monkeypatch.setattr(roles, "make_trainer", lambda cfg, path, tokenizer: object())
    cfg = load_config(None, overrides)
    return roles.start_trainer(cfg, "unused", None, Routes(None, {0: []}), placement, None)


def test_an_in_process_gpu_run_uses_the_trainer_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _start(monkeypatch, Placement(["cuda:0"], ["cuda:0"], "inprocess"), [])
        assert torch.get_num_threads() == 1  # launch.trainer_threads' default
        _start(monkeypatch, Placement(["cuda:0"], ["cuda:0"], "inprocess"), ["launch.trainer_threads=3"])
        assert torch.get_num_threads() == 3
        torch.set_num_threads(2)
        _start(monkeypatch, Placement(["cpu"], ["cpu"], "inprocess"), [])
        assert torch.get_num_threads() == 2  # a CPU run computes on its threads: left as they are
    finally:
        torch.set_num_threads(before)


def test_the_warm_start_beside_cpu_engine_processes_takes_the_cores_they_leave(monkeypatch, tmp_path):
    # On 2 cores with one engine process, 2 OpenMP threads in the controller ran the warm start
    # at 0.7-1.8 steps/s under load, against 7-9 in-process (docs/faults.md): it gets 1.
    from conveyor.launch.local import LocalLauncher
    monkeypatch.setattr(roles, "make_trainer", lambda cfg, path, tokenizer: "trainer")
    monkeypatch.setattr(roles.os, "sched_getaffinity", lambda pid: {0, 1})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cfg = load_config(None, ["launch.placement=disaggregated"])
        launcher = LocalLauncher(cfg, tmp_path)
        launcher.placement = Placement(["cpu"], ["cpu"], "shm")
        assert launcher.warm_start_trainer(cfg, "unused", None) == "trainer"
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(roles.os, "sched_getaffinity", lambda pid: set(range(8)))
        torch.set_num_threads(8)
        cfg = load_config(None, ["launch.placement=disaggregated", "launch.engines=2", "launch.engine_threads=2"])
        assert roles.warm_start_threads(cfg) == 4  # 8 cores, 2 engines of 2 threads
        torch.set_num_threads(2)
        launcher.placement = Placement(["cpu"], ["cpu"], "inprocess")  # the engine is a thread here
        launcher.warm_start_trainer(cfg, "unused", None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
