"""The session fixtures of the end-to-end tests: the two-node loopback Ray cluster the Ray tests
share (``ray_cluster.RayCluster``: started once per test session by the first test that asks for
``cluster``, stopped at the end, and no process of it may be left), and the README's default run
(``default_run``), which the workers share."""
from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def cluster():
    from ray_cluster import RayCluster
    root = Path("/tmp") / f"cvray-{uuid.uuid4().hex[:6]}"  # short: Ray's socket paths must fit 107 bytes
    saved = os.environ.get("RAY_AUTH_MODE")
    # Authentication off (the cluster listens on loopback only): Ray reads RAY_AUTH_MODE when it
    # is first imported, which in a test session may be before this fixture runs, and "disabled"
    # is what it reads when the variable is unset.
    c = RayCluster.start(root, auth="disabled")
    os.environ["RAY_AUTH_MODE"] = c.env["RAY_AUTH_MODE"]  # the driver (this process) needs it too
    try:
        yield c
    finally:
        left = c.stop()
        shutil.rmtree(root, ignore_errors=True)  # the nodes' logs and sockets
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        assert not left, f"Ray processes left after stopping the cluster: {sorted(left)}"


@pytest.fixture(scope="session")
def default_run(tmp_path_factory, worker_id) -> Path:
    """The README's first command (`conveyor train`: the default recipe, seed 0), run once per test
    session and shared by xdist's workers (the first to ask runs it under a file lock, the others
    wait for it and read it): the learning test checks it, and the LoRA learning test and the Ray
    streaming test start their RL from its warm start (``warmstart/``) instead of training the same
    warm start again. A run that failed is not reused: the next worker to ask runs it again."""
    from filelock import FileLock

    from conveyor.cli import main
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # xdist: one base directory per worker, under the session's
        root = root.parent
    run = root / "default-run"
    with FileLock(str(root / "default-run.lock")):
        if not (run / "summary.json").is_file():
            shutil.rmtree(run, ignore_errors=True)
            assert main(["train", f"--output-dir={run}", "observe.progress=false", "observe.tensorboard=false"]) == 0
    return run
