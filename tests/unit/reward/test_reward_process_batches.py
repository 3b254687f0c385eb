"""Batched rewards (a reward model) in worker processes: the thread service's scores, real batches,
a worker killed mid-batch, a hung batch at its deadline, and which rewards stay in the controller."""
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.config import RewardConfig, load_config
from conveyor.data.tiny import build_tiny
from conveyor.reward.factory import MODEL_REWARD, RewardSpec, model_spec, reward_service
from conveyor.reward.model import RewardModel
from conveyor.reward.processes import ProcessRewardService
from conveyor.reward.service import RewardService
from conveyor.run.session import SetupError, reward_model_spec
from conveyor.types import Task, Trajectory

ROOT = Path(__file__).resolve().parents[3]
SLOW = "tests.unit.reward.worker_rewards:SlowBatches"


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # workers import the test rewards by name


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    """A tiny reward model: a one-layer Llama with a scalar head of real size."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    root = tmp_path_factory.mktemp("rm")
    lm = build_tiny(root / "lm", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    tok = AutoTokenizer.from_pretrained(lm)
    torch.manual_seed(0)
    m = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=1)
    m.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        m.score.weight.normal_(0, 1.0)
    m.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    return root / "rm"


def test_a_run_passes_its_workers_the_checkpoint_not_the_model(rm_path):
    cfg = load_config(None, ["reward.fn=rm", f"reward.model={rm_path}", "reward.executor=process",
                             "reward.device=cpu", "reward.max_batch=8", "reward.normalize=sigmoid"])
    assert reward_model_spec(cfg) == RewardSpec(MODEL_REWARD, {"path": str(rm_path), "device": "cpu",
                                                               "max_batch": 8, "normalize": "sigmoid"})
    lm = load_config(None, ["reward.fn=rm", f"reward.model={rm_path.parent / 'lm'}", "reward.executor=process"])
    with pytest.raises(SetupError, match="is a LlamaForCausalLM model, not a sequence classifier"):
        reward_model_spec(lm)  # checked here, before any worker starts


def traj(i: int, text: str, prompt: str = "q") -> Trajectory:
    return Trajectory(Task(f"t{i}", prompt, None), (), (), (), (), (), text=text)


def slow(timeout_s: float = 30.0, batch_wait_s: float = 0.2, **kwargs) -> ProcessRewardService:
    return ProcessRewardService(RewardSpec(SLOW, kwargs), timeout_s=timeout_s, fallback=-1.0, workers=1,
                                batch_wait_s=batch_wait_s)


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_a_reward_model_in_worker_processes_scores_as_the_thread_service(rm_path):
    cfg = RewardConfig(fn="rm", executor="process", model=str(rm_path), device="cpu", max_batch=3, workers=2,
                       timeout_s=60.0, batch_wait_ms=50)
    spec = model_spec(cfg, "cpu")
    assert spec.fn == MODEL_REWARD and all(isinstance(v, (str, int)) for v in spec.kwargs.values())
    trajs = [traj(0, "cba", "rev:abc="), traj(1, "17", "12+5="), traj(2, "x", "rev:abcdefgh="),
             traj(3, "a much longer completion"), traj(4, "zz", "rev:zz="), traj(5, "9", "4+5="),
             traj(6, "hello there")]
    with RewardService(RewardModel(rm_path, device="cpu", max_batch=3), timeout_s=60.0, workers=1) as threads:
        expected = [t.reward for t in threads.score(trajs)]
    with reward_service(cfg, spec) as procs:
        assert isinstance(procs, ProcessRewardService) and procs.name == "rm"
        got = procs.score(trajs)
        stats = procs.stats()
    # Both run float32 on this CPU, but batches may be grouped (and so padded) differently: the
    # sums over the 32-wide hidden state may round differently, a few dozen ulps of the largest score.
    tol = 64 * float(np.finfo(np.float32).eps) * max(1.0, max(abs(s) for s in expected))
    assert [t.reward for t in got] == pytest.approx(expected, abs=tol, rel=0)
    assert [t.task.id for t in got] == [f"t{i}" for i in range(7)]
    assert len({round(s, 4) for s in expected}) == 7  # the head tells them apart
    assert stats["scored"] == 7 and stats["failures"] == stats["timeouts"] == stats["worker_deaths"] == 0
    assert math.ceil(7 / 3) <= stats["batches"] < 7


def test_trajectories_are_gathered_into_batches_of_max_batch():
    with slow(batch_wait_s=0.5, max_batch=4) as svc:
        out = svc.score([traj(i, "x" * i) for i in range(8)])  # submitted at once: two full batches
        assert [t.reward for t in out] == [float(i) for i in range(8)]
        assert [t.reward_info["batch"] for t in out] == [4] * 8
        assert svc.stats() == {"scored": 8, "failures": 0, "timeouts": 0, "nonfinite": 0, "worker_deaths": 0,
                               "restarts": 0, "batches": 2}
        start = time.monotonic()
        out = svc.score([traj(i, "y") for i in range(3)])  # fewer than max_batch: the oldest waits 0.5 s
        assert time.monotonic() - start >= 0.45
        assert [t.reward_info["batch"] for t in out] == [3] * 3 and svc.stats()["batches"] == 3


def test_a_worker_killed_mid_batch_is_replaced_and_the_batch_rescored(tmp_path):
    marker = tmp_path / "dead"
    with slow(max_batch=4, marker=str(marker)) as svc:
        out = svc.score([traj(0, "a"), traj(1, "die"), traj(2, "ccc"), traj(3, "dddd")])
        dead = int(marker.read_text())
        assert [t.reward for t in out] == [1.0, 3.0, 3.0, 4.0]
        assert all(t.reward_info["pid"] != dead and t.reward_info["batch"] == 4 for t in out)
        assert svc.stats() == {"scored": 4, "failures": 0, "timeouts": 0, "nonfinite": 0, "worker_deaths": 1,
                               "restarts": 1, "batches": 1}


def test_a_batch_whose_second_worker_dies_too_gets_the_fallback(tmp_path):
    marker = tmp_path / "dead"
    with slow(max_batch=4, marker=str(marker), dies=2) as svc:
        out = svc.score([traj(0, "a"), traj(1, "die"), traj(2, "ccc")])
        assert len(marker.read_text().split()) == 2
        assert [t.reward for t in out] == [-1.0] * 3
        assert all(t.reward_info == {"reward_error": "worker died"} for t in out)
        assert svc.stats() == {"scored": 3, "failures": 3, "timeouts": 0, "nonfinite": 0, "worker_deaths": 2,
                               "restarts": 2, "batches": 0}
        [after] = svc.score([traj(4, "fine")])  # a third worker scores what comes next
        assert after.reward == 4.0


def test_a_hung_batch_gets_the_fallback_at_its_deadline():
    with slow(timeout_s=1.0, max_batch=4, sleep_s=60.0) as svc:
        start = time.monotonic()
        futures = [svc.submit(traj(i, text)) for i, text in enumerate(["a", "hang", "cc", "ddd"])]
        out = [f.result(timeout=40) for f in futures]
        elapsed = time.monotonic() - start
        assert [t.reward for t in out] == [-1.0] * 4
        assert all(t.reward_info == {"reward_error": "timeout"} for t in out)
        # Its deadline (~1.2 s idle, counted below), not the 60 s sleep: a no-hang bound.
        assert 1.0 <= elapsed < 40.0
        stats = svc.stats()
        assert stats["timeouts"] == 4 and stats["restarts"] == 1 and stats["batches"] == 1
        out = svc.score([traj(5, "ok"), traj(6, "fine")])  # the replacement worker scores on
        assert [t.reward for t in out] == [2.0, 4.0] and out[0].reward_info["batch"] == 2


@pytest.mark.parametrize("fn, held", [("judge", "an inference engine"),
                                      ("http://127.0.0.1:9/", "a connection to its server")])
def test_rewards_the_controller_holds_are_refused_in_processes(fn, held):
    with pytest.raises(ValueError, match=f"reward.fn={fn} scores with {held} that the controller holds .* "
                                         "use reward.executor=thread"):
        RewardConfig(fn=fn, executor="process")
    assert RewardConfig(fn="rm", executor="process", model="m").executor == "process"
