"""Whole runs with trajectory reuse (``loop.replay``).

- A store that may replay nothing (``max_age`` 0) runs every step through the
  replay path and still reproduces the run without replay exactly: same
  rewards, same final weights.
- With replay on, the run trains on its fresh groups plus replayed ones, logs
  the replay metrics, and the staleness accounting stays that of the fresh
  groups (no fresh token more than ``max_staleness`` versions behind, 0 and
  1), while replayed samples are at most ``max_age`` versions old.
"""
import pytest
import torch
from safetensors.torch import load_file

from conveyor.config import load_config
from conveyor.observe.report import read_metrics
from conveyor.run.local import run_local

pytestmark = pytest.mark.slow  # several whole training runs

B, N = 4, 4
TINY = ["sft.steps=0", f"loop.batch_size={B}", f"rollout.n={N}", "data.eval_size=8", "loop.eval_every=0",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "loop.time_limit_s=null", "observe.tensorboard=false", "observe.progress=false", "trainer.lr=1e-3",
        "launch.timeout_s=120", "observe.traces_per_step=0"]


def _run(tmp_path, name, extra):
    run_dir = tmp_path / name
    run_local(load_config(None, TINY + extra), run_dir)
    return run_dir, read_metrics(run_dir, kind="train"), load_file(str(run_dir / "final" / "model.safetensors"))


def test_max_age_zero_reproduces_the_run_without_replay(tmp_path):
    _, off, w_off = _run(tmp_path, "off", ["loop.steps=3"])
    _, zero, w_zero = _run(tmp_path, "age0", ["loop.steps=3", "loop.replay.fraction=0.5", "loop.replay.max_age=0"])
    assert [m["reward"] for m in zero] == [m["reward"] for m in off]
    assert all(m["replay/groups"] == 0 and m["replay/store_size"] == 0 for m in zero)
    assert w_off.keys() == w_zero.keys() and all(torch.equal(w_off[k], w_zero[k]) for k in w_off)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_replay_trains_logs_its_metrics_and_keeps_staleness_accounting(tmp_path, max_staleness):
    steps, age = 5, 2
    _, on, w_on = _run(tmp_path, "on", [f"loop.steps={steps}", "loop.replay.fraction=0.5",
                                        f"loop.max_staleness={max_staleness}",
                                        f"loop.replay.max_age={age}", "loop.replay.max_uses=1",
                                        "reward.fn=tests.unit.reward.worker_rewards:length"])  # signal in most groups
    assert len(on) == steps
    replayed = [m["replay/groups"] for m in on]
    assert replayed[0] == 0 and sum(replayed) > 0, replayed  # nothing to replay at the first step
    for m in on:
        assert m["replay/groups"] <= B // 2
        assert m["num_seqs"] == B * N + m["replay/samples"]  # fresh samples plus the replayed ones
        assert m["staleness_max"] <= max_staleness  # the fresh groups, under the staleness rule
        if m["replay/groups"]:
            assert 1 <= m["replay/age_mean"] <= m["replay/age_max"] <= age
            assert "behaviour_weight_mean" in m  # decoupled PPO weighted the batch
    base = load_file(str(tmp_path / "on" / "base_model" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in w_on.values())
    assert any(not torch.equal(base[k], w_on[k]) for k in w_on)  # it trained
