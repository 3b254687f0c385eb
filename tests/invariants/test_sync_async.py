"""Invariants of the streaming machinery.

- With max_staleness 0, trainer and engine in processes of their own
  (disaggregated) reproduce the in-process synchronous run exactly, with
  weights through shared memory or a gloo broadcast; two FSDP trainer ranks
  (gloo) reproduce it to float tolerance.
  So does the streaming engine (paged runner, continuous batching).
- With max_staleness 2 no trained token is more than 2 versions behind the
  policy being trained, with partial rollouts on and off, and streaming; and
  its first step trains on the synchronous run's first samples.
"""
import pytest
import torch
from safetensors.torch import load_file

from conveyor.config import load_config
from conveyor.observe.report import read_metrics
from conveyor.run.local import run_local
from conveyor.trainer.checkpoint import export_hf

pytestmark = pytest.mark.slow  # a whole training run or several: `pytest -m "not slow"` leaves it out

TINY = ["sft.steps=0", "loop.batch_size=4", "rollout.n=4", "data.eval_size=8", "loop.eval_every=0",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "loop.time_limit_s=null", "observe.tensorboard=false", "observe.progress=false",
        "trainer.lr=1e-3", "launch.engine_threads=1", "launch.trainer_threads=1", "launch.timeout_s=120"]


def _run(tmp_path, name, extra):
    run_dir = tmp_path / name
    run_local(load_config(None, TINY + extra), run_dir)
    return run_dir


def test_staleness_zero_processes_equal_in_process(tmp_path):
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # the same thread count as the child processes: same float sums
    try:
        a = _run(tmp_path, "colocated", ["loop.steps=3", "launch.placement=colocated"])
    finally:
        torch.set_num_threads(prev)
    ra = [m["reward"] for m in read_metrics(a, kind="train")]
    assert len(ra) == 3
    wa = load_file(str(a / "final" / "model.safetensors"))
    runs = {"shm": ["launch.placement=disaggregated"],
            "broadcast": ["launch.placement=disaggregated", "launch.weight_sync=broadcast"],
            "fsdp2": ["launch.placement=disaggregated", "launch.weight_sync=broadcast", "launch.trainer_ranks=2",
                      "loop.checkpoint_every=3"],
            "replicate": ["launch.placement=disaggregated", "launch.weight_sync=broadcast", "launch.trainer_ranks=2",
                          "trainer.parallel=replicate", "loop.checkpoint_every=3"]}
    for name, over in runs.items():
        b = _run(tmp_path, name, ["loop.steps=3"] + over)
        wb = load_file(str(b / "final" / "model.safetensors"))
        assert wa.keys() == wb.keys(), name
        for k in wa:
            if name in ("fsdp2", "replicate"):  # the gradient is summed over two ranks: float order differs
                torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")
            else:
                assert torch.equal(wa[k], wb[k]), (name, k)
        train = read_metrics(b, kind="train")
        assert [m["reward"] for m in train] == ra, name
        if name in ("fsdp2", "replicate"):  # its checkpoint (sharded or rank 0's) exports to the same weights
            export_hf(b / "checkpoints" / "step_000003", tmp_path / f"exported-{name}")
            we = load_file(str(tmp_path / f"exported-{name}" / "model.safetensors"))
            assert all(torch.equal(we[k], wb[k]) for k in wb)
        assert all(m["staleness_max"] == 0 for m in train), name


def test_staleness_zero_streaming_engine_processes_equal_in_process(tmp_path):
    # The fast runner streams (continuous batching, weights applied between decode steps):
    # at staleness 0 that must still be exactly the synchronous run, in a thread or a process.
    fast = ["loop.steps=3", "rollout.runner=fast", "loop.partial_rollouts=true"]
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = _run(tmp_path, "colocated-fast", fast + ["launch.placement=colocated"])
    finally:
        torch.set_num_threads(prev)
    b = _run(tmp_path, "disaggregated-fast", fast + ["launch.placement=disaggregated"])
    wa, wb = (load_file(str(d / "final" / "model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = ([m["reward"] for m in read_metrics(d, kind="train")] for d in (a, b))
    assert ra == rb and len(ra) == 3
    for d in (a, b):  # the engine's decode time by rows reaches the loop, from a thread or a process
        low = [m.get("engine_low_rows_frac") for m in read_metrics(d, kind="train")]
        assert len(low) == 3 and all(x is not None and 0.0 <= x <= 1.0 for x in low), low


def test_bounded_staleness_is_respected(tmp_path):
    # Step 1 of every run trains on samples of the same weights (version 0); with per-sample
    # random streams keyed by the task's place they are the sync run's samples, however the
    # engine batched them (waves, one stream, merged chunks) and with either runner.
    sync = _run(tmp_path, "sync", ["loop.steps=1", "launch.placement=disaggregated"])
    first = read_metrics(sync, kind="train")[0]["reward"]
    for partial, runner in ((True, "hf"), (False, "hf"), (True, "fast")):  # fast + partial: streaming
        d = _run(tmp_path, f"async-{partial}-{runner}", ["loop.steps=6", "loop.max_staleness=2",
                                                         f"loop.partial_rollouts={str(partial).lower()}",
                                                         f"rollout.runner={runner}",
                                                         "launch.placement=disaggregated"])
        train = read_metrics(d, kind="train")
        assert len(train) == 6
        assert max(m["staleness_max"] for m in train) <= 2
        assert all(0.0 <= m["reward"] <= 1.0 for m in train)
        assert train[0]["reward"] == first, (partial, runner)


def test_bounded_staleness_holds_with_the_next_batch_built_during_training(tmp_path):
    # one optimizer step per batch: no proximal recompute, so each step's batch is built on a
    # thread while the step before trains (step_batch.Prefetch) and no step prepares its own
    d = _run(tmp_path, "async-prefetch", ["loop.steps=6", "loop.max_staleness=2", "trainer.mini_batches=1",
                                          "launch.placement=disaggregated"])
    train = read_metrics(d, kind="train")
    assert len(train) == 6
    assert train[0]["time/prepare"] > 0 and all(m["time/prepare"] == 0.0 for m in train[1:])
    assert max(m["staleness_max"] for m in train) <= 2
    assert all(0.0 <= m["reward"] <= 1.0 for m in train)
