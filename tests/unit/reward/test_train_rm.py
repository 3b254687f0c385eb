"""conveyor train-rm: preference pairs checked before training, Bradley-Terry training, a checkpoint
that reward.fn=rm scores exactly as train-rm measured it."""
import json
import random
import string

import pytest
import torch

from conveyor.cli import main
from conveyor.data.api import DataError
from conveyor.data.preferences import PreferencePair, prompt_text, read_pairs, synthetic_pairs, write_pairs
from conveyor.data.synthetic import partial_credit, synthetic_source
from conveyor.data.tiny import build_tiny
from conveyor.reward.model import STATS_FILE, RewardModel, RewardModelError
from conveyor.reward.train_rm import RMTrainConfig, split_pairs, train_reward_model
from conveyor.types import Task, Trajectory

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("base") / "lm", **TINY)


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "p", "chosen": "a", "rejected": "b"', "not valid JSON"),
    ('["p", "a", "b"]', "a row must be a JSON object"),
    ('{"prompt": "p", "chosen": "a"}', "missing 'rejected'"),
    ('{"prompt": "p", "chosen": "a", "rejected": "a"}', "chosen and rejected are the same text"),
    ('{"prompt": "p", "chosen": "  ", "rejected": "b"}', "'chosen' is empty"),
    ('{"prompt": "p", "chosen": 3, "rejected": "b"}', "'chosen' must be a string or a list of one assistant"),
    ('{"prompt": 7, "chosen": "a", "rejected": "b"}', "'prompt' must be a string or a non-empty list"),
    (('{"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}], '
      '"rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]}'),
     "must share every message but the last"),
    ('{"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}',
     "must be a conversation"),
])
def test_a_broken_row_is_named_with_its_line(tmp_path, line, needle):
    f = tmp_path / "pairs.jsonl"
    f.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=needle) as e:
        read_pairs(f)
    assert str(e.value).startswith(f"{f}:3: ")  # the blank line 2 is counted, not read


def test_a_row_that_is_not_utf8_is_named_with_its_line(tmp_path):
    f = tmp_path / "pairs.jsonl"
    f.write_bytes(b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "\xff", "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(DataError) as e:
        read_pairs(f)
    assert str(e.value) == f"{f}:2: is not UTF-8 text (byte 0xff at byte 13 of the line); save the file as UTF-8"


def test_the_three_row_forms(tmp_path, lm):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(lm)
    conv = [{"role": "user", "content": "hi"}]
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "p=", "chosen": "a", "rejected": "b"},
        {"prompt": conv, "chosen": [{"role": "assistant", "content": "yes"}], "rejected": "no"},
        {"chosen": conv + [{"role": "assistant", "content": "yes"}], "rejected": conv + [{"role": "assistant", "content": "no"}]},
    ]) + "\n")
    a, b, c = read_pairs(f)
    assert (a.prompt, a.chosen, a.rejected, a.line) == ("p=", "a", "b", 1)
    assert (b.chosen, b.rejected) == (c.chosen, c.rejected) == ("yes", "no") and b.prompt == c.prompt
    assert prompt_text(tok, a) == "p="
    assert prompt_text(tok, b) == prompt_text(tok, c) == "<|user|>hi\n<|assistant|>"


def test_cli_refuses_broken_pairs_before_training(tmp_path, lm, capsys):
    f = tmp_path / "pairs.jsonl"
    f.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "q", "chosen": "same", "rejected": "same"}\n')
    assert main(["train-rm", str(f), "--model", str(lm), "--out", str(tmp_path / "rm")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"conveyor: error: {f}:2: chosen and rejected are the same text, which teaches nothing; "
                       "remove the row or fix one of them")
    assert not (tmp_path / "rm").exists()


def test_bad_bases_and_settings_are_named(tmp_path, lm):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    f = write_pairs(tmp_path / "p.jsonl", [PreferencePair("a", "x", "y"), PreferencePair("b", "x", "y")])
    two = tmp_path / "two"
    AutoModelForSequenceClassification.from_pretrained(lm, num_labels=2).save_pretrained(two)
    AutoTokenizer.from_pretrained(lm).save_pretrained(two)
    with pytest.raises(RewardModelError, match=r"--model .* has 2 outputs"):
        train_reward_model(RMTrainConfig(str(f), str(two), str(tmp_path / "o1")), log=lambda s: None)
    with pytest.raises(RewardModelError, match="no config.json"):
        train_reward_model(RMTrainConfig(str(f), str(tmp_path), str(tmp_path / "o2")), log=lambda s: None)
    with pytest.raises(DataError, match="--eval-fraction must be in"):
        RMTrainConfig(str(f), str(lm), "o", eval_fraction=1.5)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(DataError, match="exists and is not an empty directory"):
        train_reward_model(RMTrainConfig(str(f), str(lm), str(tmp_path / "full")), log=lambda s: None)


def test_held_out_prompts_are_never_trained_on():
    pairs = [PreferencePair(f"p{i % 30}", f"a{i}", f"b{i}") for i in range(120)]
    train, held = split_pairs(pairs, 0.2, seed=3)
    assert len(train) + len(held) == 120
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held})
    assert len({p.prompt for p in held}) == 6
    assert split_pairs(pairs, 0.2, seed=3) == (train, held)


def _rm_pairs(n: int, seed: int) -> list[PreferencePair]:
    """Easy preferences: a completion of the letter the prompt names over one of another letter."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        want, other = rng.sample(string.ascii_lowercase[:6], 2)
        out.append(PreferencePair(f"{i}:{want}=", want * 3, other * 3, i + 1))
    return out


def test_training_learns_and_the_checkpoint_scores_as_measured(tmp_path, lm):
    torch.set_num_threads(1)
    data = write_pairs(tmp_path / "pairs.jsonl", _rm_pairs(400, 0))
    lines = []
    cfg = RMTrainConfig(str(data), str(lm), str(tmp_path / "rm"), lr=3e-3, batch_size=16, steps=200,
                        eval_every=100, eval_fraction=0.2, seed=1)
    r = train_reward_model(cfg, log=lines.append)
    assert [e.step for e in r.history] == [0, 100, 200]
    assert r.train_pairs == 320 and r.heldout_pairs == 80
    # Held out, above a coin by more than 3 standard errors of one (0.5 + 1.5 / sqrt(80) = 0.67).
    assert r.final.accuracy > 0.5 + 3 * (0.25 / r.heldout_pairs) ** 0.5, lines
    assert r.final.loss < r.history[0].loss, lines
    assert lines[0].startswith("train-rm: 320 pairs to train on, 80 held out (their prompts never trained on); "
                               f"model {lm} (LlamaForCausalLM: a new scalar head) on cpu; 200 steps of 16 pairs")
    assert lines[-1].startswith(f"final (step 200): held-out loss {r.final.loss:.4f}  accuracy {r.final.accuracy:.3f}")
    stats = json.loads((tmp_path / "rm" / STATS_FILE).read_text())
    assert stats["heldout_accuracy"] == r.final.accuracy and len(stats["history"]) == 3
    # reward.fn=rm reads the same sequences: its scores reproduce train-rm's held-out accuracy and
    # score statistics (float32 on both sides; batches padded differently: a few ulps).
    _, held = split_pairs(read_pairs(data), 0.2, seed=1)
    rm = RewardModel(tmp_path / "rm", max_batch=7)
    chosen = rm.score_batch([Trajectory(Task("c", p.prompt, None), (), (), (), (), (), text=p.chosen) for p in held])
    rejected = rm.score_batch([Trajectory(Task("r", p.prompt, None), (), (), (), (), (), text=p.rejected) for p in held])
    assert sum(c > x for c, x in zip(chosen, rejected)) / len(held) == r.final.accuracy
    scores = chosen + rejected
    mean = sum(scores) / len(scores)
    assert mean == pytest.approx(r.score_mean, abs=1e-4 * max(1.0, abs(r.score_mean), r.score_std))
    # An existing reward model trains on (its head is kept): one more step from where it was.
    more = train_reward_model(RMTrainConfig(str(data), str(tmp_path / "rm"), str(tmp_path / "rm2"), lr=1e-4,
                                            batch_size=16, steps=1, eval_fraction=0.2, seed=1), log=lines.append)
    assert "(a reward model: its head trains on)" in lines[-3]
    assert more.history[0].accuracy == r.final.accuracy


def test_synthetic_pairs_prefer_what_the_gold_verifier_prefers(tmp_path):
    pairs = synthetic_pairs("reverse", 300, {"length": 4}, eval_size=50, seed=0)
    eval_prompts = {t.prompt for t in synthetic_source("reverse", "eval", {"length": 4}, 50, 0).tasks}
    assert len(pairs) == 300 and not eval_prompts & {p.prompt for p in pairs}
    for p in pairs:
        task = Task("x", p.prompt, p.prompt[4:-1][::-1], {"task": "reverse"})
        good = partial_credit(Trajectory(task, (), (), (), (), (), text=p.chosen))
        bad = partial_credit(Trajectory(task, (), (), (), (), (), text=p.rejected))
        assert good["exact"] == 1.0 and bad["exact"] == 0.0 and good["reward"] > bad["reward"]
    copies = sum(p.rejected == p.prompt[4:-1] for p in pairs)
    assert 0.15 < copies / len(pairs) < 0.35  # the teacher's mistake, about a quarter
    sums = synthetic_pairs("addition", 50, {"digits": 2}, eval_size=10, seed=0)
    assert all(p.chosen == str(eval(p.prompt[:-1])) != p.rejected for p in sums)
    with pytest.raises(DataError, match="synthetic pairs exist for addition and reverse"):
        synthetic_pairs("guess", 5)
