"""The one process of an in-process run on a GPU keeps ``launch.trainer_threads`` torch threads: its
CPU work is the host side of GPU kernels, where a thread pool's wake-ups cost more than they save.
On CPU the trainer computes on those threads, so nothing is changed there."""
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
