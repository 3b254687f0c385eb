"""The run's console: phase lines off a terminal, eval lines, the summary, length-skip reports."""
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from conveyor.data.api import DataError
from conveyor.observe.progress import PhaseProgress, report_length_skips, summary_text
from conveyor.types import Task


def test_plain_lines_every_nth_step_per_phase():
    out = io.StringIO()
    p = PhaseProgress(rl_steps=40, sft_steps=100, stream=out)  # not a terminal: plain lines
    for s in range(9, 100, 10):  # the warm-start logs every 10th step (0-based)
        p.log(s, {"sft_loss": 1.0 / (s + 1)}, kind="sft")
    p.log(0, {"eval_reward": 0.25, "eval_sampled_reward": 0.125, "eval_exact": 0.0}, kind="eval")
    for s in range(1, 41):
        p.log(s, {"reward": 0.5, "loss": -0.01, "samples_per_s": 300.0, "grad_norm": 1.0})
    p.close()
    lines = out.getvalue().splitlines()
    sft = [l for l in lines if l.startswith("[warm-start]")]
    rl = [l for l in lines if l.startswith("[RL]")]
    # about 20 lines a phase: every 5th warm-start step (logged per 10) and every 2nd RL step
    assert [l.split()[2] for l in sft] == [f"{s}/100" for s in range(10, 101, 10)]
    assert [l.split()[2] for l in rl] == ["1/40"] + [f"{s}/40" for s in range(3, 41, 2)] + ["40/40"]
    assert rl[-1].endswith("| reward=0.5 loss=-0.01 samples/s=300 eval=0.25")
    assert "eval @ step 0: greedy reward 0.250, sampled 0.125, exact 0.000" in lines
    assert not any("grad_norm" in l for l in lines)


def test_plain_lines_every_log_every_steps():
    out = io.StringIO()
    p = PhaseProgress(rl_steps=10, every=5, stream=out)
    for s in range(1, 11):
        p.log(s, {"reward": 1.0})
    assert [l.split()[2] for l in out.getvalue().splitlines()] == ["1/10", "6/10", "10/10"]


def test_summary_table_layout_and_commands(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "config.yaml").write_text("")
    summary = {"eval_reward_initial": 0.015, "eval_reward_warmstart": 0.742, "eval_reward_final": 0.84,
               "eval_sampled_reward_initial": 0.01, "eval_sampled_reward_warmstart": 0.5,
               "eval_sampled_reward_final": 0.7, "eval_exact_initial": 0.0, "eval_exact_warmstart": 0.4,
               "eval_exact_final": 0.6, "steps": 300, "wall_seconds": 191.2,
               "final_metrics": {"prompt_too_long": 3}, "max_prompt_tokens": 255}
    text = summary_text(summary, tmp_path, [Task(id="e-1", prompt="12+34=", answer="46")])
    lines = text.splitlines()
    assert "greedy reward          0.015       0.742       0.840" in lines
    assert "sampled reward         0.010       0.500       0.700" in lines
    assert "exact answers          0.000       0.400       0.600" in lines
    assert "300 RL steps, 191s in all" in lines
    assert any(l.startswith("note: 3 training prompts were skipped: longer than the model's context (255 "
                            "prompt tokens); shorten") for l in lines)
    assert f"  conveyor generate {tmp_path} 12+34=" in lines and f"  conveyor eval {tmp_path}" in lines
    assert any(l.startswith("  final/") for l in lines) and not any(l.startswith("  warmstart/") for l in lines)
    # a reward without an exact metric: no exact row
    assert "exact answers" not in summary_text({"eval_reward_final": 1.0}, Path(tmp_path))


def test_length_skips_are_reported_once_and_none_left_is_an_error():
    msgs, reported = [], {}
    logger = SimpleNamespace(message=msgs.append)
    report_length_skips(logger, 5, 3, 10, "eval_", reported)
    report_length_skips(logger, 5, 3, 10, "eval_", reported)
    assert len(msgs) == 1 and msgs[0].startswith("note: 3 of 10 held-out prompts skipped")
    assert "(5 prompt tokens)" in msgs[0] and "model.tiny.max_position_embeddings" in msgs[0]
    assert reported == {"eval_prompt_too_long": 3}
    with pytest.raises(DataError, match=r"all 10 held-out prompts are longer than the model's context "
                                        r"\(5 prompt tokens\), so nothing is left to evaluate; shorten"):
        report_length_skips(logger, 5, 10, 10, "eval_", reported)
