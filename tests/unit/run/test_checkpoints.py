"""Which checkpoints a run keeps, how a resume rewinds the logs, and the totals it carries on."""
import json
import time

from conveyor.run import checkpoints
from conveyor.run.checkpoints import Totals


def _ckpt(run_dir, step, reward=None):
    d = run_dir / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    extra = {"step": step, **({"eval_reward": reward} if reward is not None else {})}
    (d / "extra.json").write_text(json.dumps(extra))
    return d


def test_prune_keeps_the_newest_and_the_best(tmp_path):
    for step, reward in [(2, 0.5), (4, 0.9), (6, None), (8, 0.7), (10, None)]:
        _ckpt(tmp_path, step, reward)
    gone = checkpoints.prune(tmp_path, keep_last=2, keep_best=True)
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_000004", "step_000008", "step_000010"]
    assert sorted(p.name for p in gone) == ["step_000002", "step_000006"]
    assert checkpoints.latest(tmp_path).name == "step_000010"
    checkpoints.prune(tmp_path, keep_last=1, keep_best=False)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000010"]
    assert checkpoints.prune(tmp_path, keep_last=None, keep_best=True) == []


def test_rewind_drops_later_steps_and_torn_lines(tmp_path):
    now = time.time()
    rows = [{"step": 0, "kind": "eval", "time": now}, {"step": 5, "kind": "sft", "time": now},
            *({"step": s, "kind": "train", "time": now + s} for s in range(1, 7)),
            {"step": 4, "kind": "eval", "time": now + 4.5}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "ki'  # torn by a kill
    (tmp_path / "metrics.jsonl").write_text(text)
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 4, 5, 5, 6)))
    out = checkpoints.rewind(tmp_path, 4)
    kept = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in kept] == [(0, "eval"), (5, "sft"), (1, "train"), (2, "train"),
                                                      (3, "train"), (4, "train"), (4, "eval")]
    assert out.dropped == {"metrics.jsonl": 3, "traces.jsonl": 3}
    assert out.last_time == now + 6
    assert out.lost_seconds(now + 4) == 2.0 and out.lost_seconds(None) == 0.0
    assert [json.loads(l)["step"] for l in (tmp_path / "traces.jsonl").read_text().splitlines()] == [1, 4]


def test_totals_carry_counters_and_time_over_resumes():
    first = Totals().since(100.0, 80.0, 4, {"reward_timeouts": 2, "engine_restarts": 1})
    again = Totals.of({"totals": first.to_json()})
    assert again == first
    # The resumed part counts from zero; the whole run's numbers are the sum.
    assert again.offset({"reward_timeouts": 3, "engine_restarts": 0, "env_crashes": 1}) == {
        "reward_timeouts": 5, "engine_restarts": 1, "env_crashes": 1}
    later = again.since(50.0, 40.0, 8, again.offset({"reward_timeouts": 3}))
    assert (later.wall_seconds, later.rl_seconds, later.steps) == (150.0, 120.0, 8)
    assert Totals.of({}) == Totals()
