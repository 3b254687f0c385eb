"""A role process that dies mid-run stops the run within seconds, naming the role."""
import os
import re
import signal
import subprocess
import sys
import time


import pytest

pytestmark = pytest.mark.slow  # a whole training run or several: `pytest -m "not slow"` leaves it out


@pytest.mark.parametrize("role, extra", [
    ("engine0", ["launch.max_restarts=0"]),  # engines are restarted by default (tests/e2e/test_faults.py)
    # The engine dies while its receiver thread is in the broadcast group (and is not replaced).
    ("engine0", ["launch.max_restarts=0", "launch.weight_sync=broadcast"]),
    # One of two FSDP ranks dies: its peer is blocked in a collective, the controller must not be.
    ("trainer1", ["launch.trainer_ranks=2", "launch.weight_sync=broadcast"]),
])
def test_killed_role_stops_the_run(tmp_path, role, extra):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run_dir}", "sft.steps=0",
           "loop.steps=100000", "loop.batch_size=4", "rollout.n=4", "data.eval_size=8",
           "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
           "loop.time_limit_s=null", "observe.tensorboard=false", "observe.progress=false",
           "launch.placement=disaggregated", "launch.timeout_s=120", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run_dir / "logs" / f"{role}.log"
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # wait until training steps are running
        if metrics.exists() and '"kind": "train"' in metrics.read_text():
            break
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    pid = int(re.search(rf"\[{role}\] started pid=(\d+)", log.read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=110)
    finally:
        proc.kill()
    # No-hang bound (seconds idle): the lines below say the death stopped it, not launch.timeout_s (120 s).
    assert time.monotonic() - t0 < 100, "the controller took too long to notice"
    assert proc.returncode == 1
    assert f"conveyor: run stopped: {role} process exited with code -9" in err, err[-3000:]
    assert "last lines of" in err and f"{role}.log" in err


def test_a_non_finite_loss_stops_the_run_in_one_line(tmp_path):
    # lr 1e30 without clipping: the first mini-batch's update leaves weights whose loss is not finite
    cmd = [sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={tmp_path / 'run'}", "sft.steps=0",
           "trainer.lr=1e30", "trainer.max_grad_norm=null", "loop.steps=6", "loop.batch_size=4", "rollout.n=4",
           "data.eval_size=8", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
           "model.tiny.intermediate_size=64", "observe.tensorboard=false", "observe.progress=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"^conveyor: run stopped: trainer step \d+, .*: (loss|gradient norm) is (nan|-?inf); "
                     r"no optimizer step was taken", proc.stderr, re.M), proc.stderr[-3000:]
