"""Trajectory traces: the best, the worst and random others per step, their fields, the size bound."""
from __future__ import annotations

import pytest

from conveyor.data.tiny import build_tokenizer
from conveyor.observe.traces import TraceWriter, read_traces
from conveyor.types import Group, Task, Trajectory, TurnRecord


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def traj(tok, task, text, reward, versions=None, turns=()):
    ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
    return Trajectory(task=task, prompt_ids=tuple(tok(task.prompt, add_special_tokens=False)["input_ids"]),
                      completion_ids=ids, logprobs=(-0.5,) * len(ids),
                      versions=tuple(versions or [3] * len(ids)), loss_mask=(1,) * len(ids), text=text,
                      reward=reward, reward_info={"reward": reward, "exact": float(reward == 1.0)},
                      turn_records=tuple(turns))


def test_best_worst_and_random_others_with_their_fields(tmp_path, tok):
    task = Task("t0", "rev:abc=", answer="cba")
    rewards = [0.3, 1.0, 0.0, 0.5, 0.6, 0.2]
    trajs = [traj(tok, task, f"x{i}", r) for i, r in enumerate(rewards)]
    trajs[3] = traj(tok, task, "cb", 0.5, versions=[2, 4], turns=[TurnRecord(0, 1, 0.5, ("calculator",), 0.01)])
    w = TraceWriter(tmp_path, tok, per_step=4, seed=0)
    w.write(7, [Group(task, tuple(trajs))])
    recs = read_traces(tmp_path, step=7)
    assert len(recs) == 4
    assert [r["reward"] for r in recs[:2]] == [1.0, 0.0]  # the best, then the worst
    assert recs[0]["prompt"] == "rev:abc=" and recs[0]["completion"] == "x1"
    assert recs[0]["versions"] == {"min": 3, "max": 3, "distinct": 1}
    assert recs[0]["reward_info"]["exact"] == 1.0
    again = TraceWriter(tmp_path / "b", tok, per_step=4, seed=0)
    (tmp_path / "b").mkdir()
    again.write(7, [Group(task, tuple(trajs))])
    assert [r["completion"] for r in read_traces(tmp_path / "b")] == [r["completion"] for r in recs]  # seeded
    w.write(8, [Group(task, (trajs[3],))])
    (r8,) = read_traces(tmp_path, step=8)
    assert r8["versions"] == {"min": 2, "max": 4, "distinct": 2}
    assert r8["turns"] == [{"start": 0, "end": 1, "reward": 0.5, "tool_calls": ["calculator"], "env_s": 0.01,
                            "error": ""}]
    assert len(read_traces(tmp_path)) == 5


def test_size_bound_and_off(tmp_path, tok):
    task = Task("t0", "p=")
    group = Group(task, tuple(traj(tok, task, "y" * 200, 0.1 * i) for i in range(8)))
    w = TraceWriter(tmp_path, tok, per_step=8, max_mb=2000 / 2**20)  # about 2 kB
    for step in range(5):
        w.write(step, [group])
    assert (tmp_path / "traces.jsonl").stat().st_size <= 2000
    assert w.skipped >= 8
    off = TraceWriter(tmp_path / "off", tok, per_step=0)
    off.write(1, [group])
    assert not (tmp_path / "off" / "traces.jsonl").exists()
    with pytest.raises(FileNotFoundError, match="the run wrote none"):
        read_traces(tmp_path / "off")
