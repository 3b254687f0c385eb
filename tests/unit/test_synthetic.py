import pytest

from conveyor.data.synthetic import (
    partial_credit,
    score_text,
    sft_pairs,
    synthetic_source,
)
from conveyor.types import Task, Trajectory


def _traj(task, text):
    return Trajectory(task, (1,), (), (), (), (), text=text)


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_splits_are_disjoint_and_seeded():
    tr = synthetic_source("addition", "train", {"digits": 2}, eval_size=50, seed=3)
    ev = synthetic_source("addition", "eval", {"digits": 2}, eval_size=50, seed=3)
    assert len(ev) == 50
    assert not {t.prompt for t in tr.tasks} & {t.prompt for t in ev.tasks}
    again = synthetic_source("addition", "eval", {"digits": 2}, eval_size=50, seed=3)
    assert [t.prompt for t in again.tasks] == [t.prompt for t in ev.tasks]
    p, a = sft_pairs(ev)[0]
    x, y = p[:-1].split("+")
    assert int(x) + int(y) == int(a)


def test_partial_credit_values():
    assert score_text("85", "85", right_align=True) == 1.0
    assert score_text("75", "85", right_align=True) == 0.5
    assert score_text("5", "85", right_align=True) == 0.5     # right-aligned: units digit right
    assert score_text("185", "85", right_align=True) == 2 / 3  # an extra digit costs credit
    assert score_text("", "85", right_align=True) == 0.0
    assert score_text("abd", "abc", right_align=False) == 2 / 3
    t = Task("t", "47+38=", "85", {"task": "addition"})
    assert partial_credit(_traj(t, "85")) == {"reward": 1.0, "exact": 1.0}
    assert partial_credit(_traj(t, "95"))["reward"] == 0.5


def test_reverse_task():
    ev = synthetic_source("reverse", "eval", {"length": 4}, eval_size=10, seed=0)
    t = ev[0]
    s = t.prompt[len("rev:"):-1]
    assert t.answer == s[::-1]
    assert partial_credit(_traj(t, t.answer))["reward"] == 1.0


def test_imperfect_teacher_drops_carries_only():
    import random

    from conveyor.data.synthetic import sum_without_carry
    assert sum_without_carry(47, 38) == "75"   # units carry dropped
    assert sum_without_carry(67, 58) == "15"   # both carries dropped
    assert sum_without_carry(12, 34) == "46"   # no carry: the true sum
    src = synthetic_source("addition", "train", {"digits": 2, "teacher_error": 1.0}, eval_size=10, seed=0)
    rng = random.Random(0)
    for t in src.tasks[:50]:
        a, b = (int(x) for x in t.prompt[:-1].split("+"))
        assert src.demonstration(t, rng) == sum_without_carry(a, b)
        assert t.answer == str(a + b)          # tasks and rewards keep the true answer
    clean = synthetic_source("addition", "train", {"digits": 2}, eval_size=10, seed=0)
    assert all(clean.demonstration(t, rng) == t.answer for t in clean.tasks[:50])


def test_imperfect_reversing_teacher_copies_at_its_error_rate():
    import random

    src = synthetic_source("reverse", "train", {"length": 5, "teacher_error": 0.6}, eval_size=10, seed=0)
    rng = random.Random(0)
    shown = [(t, src.demonstration(t, rng)) for t in src.tasks[:2000]]
    copied = [t.prompt[len("rev:"):-1] == d for t, d in shown]
    assert all(d in (t.answer, t.answer[::-1]) for t, d in shown)  # the answer or the string as written
    assert abs(sum(copied) / len(copied) - 0.6) < 0.05              # ~4.5 binomial sd of 2000 draws
    assert all(t.answer == t.prompt[len("rev:"):-1][::-1] for t, _ in shown)  # rewards keep the reverse


def test_prompt_template_names_the_parts_of_a_task():
    """A pretrained model reads the task as a question; the plain prompt and its parts stay in info,
    and the imperfect teacher still works from the parts."""
    import random

    from conveyor.data.synthetic import fields
    assert fields("addition", "47+38=") == {"a": "47", "b": "38"} and fields("reverse", "rev:abc=") == {"text": "abc"}
    src = synthetic_source("addition", "train", {"digits": 2, "teacher_error": 1.0}, eval_size=4, seed=0,
                           render=lambda p, f: f"What is {f['a']} + {f['b']}?")
    t = src[0]
    a, b = t.info["fields"]["a"], t.info["fields"]["b"]
    assert t.prompt == f"What is {a} + {b}?" and t.info["raw_prompt"] == f"{a}+{b}=" and t.answer == str(int(a) + int(b))
    from conveyor.data.synthetic import sum_without_carry
    assert src.demonstration(t, random.Random(0)) == sum_without_carry(int(a), int(b))
    plain = synthetic_source("addition", "train", {"digits": 2}, eval_size=4, seed=0)
    assert plain[0].info["fields"] == t.info["fields"] and "raw_prompt" not in plain[0].info


def test_run_renders_synthetic_prompts_through_the_templates():
    import pytest

    from conveyor.config import load_config
    from conveyor.data.tiny import build_tokenizer
    from conveyor.run.session import SetupError, load_sources
    tok = build_tokenizer()
    cfg = load_config(None, ["data.source=synthetic:reverse", "data.prompt_template=Reverse {text}.",
                             "data.chat_template=true", "data.eval_size=4"])
    train, _ = load_sources(cfg, tok)
    word = train[0].info["fields"]["text"]
    assert train[0].prompt == f"<|user|>Reverse {word}.\n<|assistant|>"
    bad = load_config(None, ["data.source=synthetic:reverse", "data.prompt_template=Add {a}", "data.eval_size=4"])
    with pytest.raises(SetupError, match=r"data.prompt_template names 'a' which task 'reverse' does not have; "
                                         r"its fields: prompt, text"):
        load_sources(bad, tok)


def test_sums_of_more_terms_name_every_part():
    from conveyor.data.synthetic import fields
    for terms in (3, 5):
        ev = synthetic_source("addition", "eval", {"digits": 2, "terms": terms}, eval_size=20, seed=0)
        for t in ev.tasks:
            parts = t.info["fields"]
            assert list(parts) == list("abcde"[:terms])
            assert t.prompt == "+".join(parts.values()) + "="
            assert all(0 <= int(v) <= 99 for v in parts.values())
            assert t.answer == str(sum(int(v) for v in parts.values()))
    assert fields("addition", "4+7+3=") == {"a": "4", "b": "7", "c": "3"}
    src = synthetic_source("addition", "eval", {"digits": 1, "terms": 3}, eval_size=4, seed=0,
                           render=lambda p, f: "What is {a} + {b} + {c}?".format(**f))
    a, b, c = src[0].info["fields"].values()
    assert src[0].prompt == f"What is {a} + {b} + {c}?" and src[0].answer == str(int(a) + int(b) + int(c))
    assert partial_credit(_traj(src[0], src[0].answer)) == {"reward": 1.0, "exact": 1.0}


def test_two_terms_are_the_sums_drawn_before_the_option():
    """Recipes and tests rely on the seed's sums: naming terms=2 or leaving it out changes none of them."""
    plain = synthetic_source("addition", "eval", {"digits": 2}, eval_size=5, seed=0)
    named = synthetic_source("addition", "eval", {"digits": 2, "terms": 2}, eval_size=5, seed=0)
    # the first sums of seed 0 as drawn by rng.randint(0, 99) twice per sum from Random("addition-0")
    import random
    rng = random.Random("addition-0")
    first = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(5)]
    assert [t.prompt for t in plain.tasks] == [f"{a}+{b}=" for a, b in first]
    assert [(t.prompt, t.answer, t.info) for t in named.tasks] == [(t.prompt, t.answer, t.info) for t in plain.tasks]


def test_bad_terms_are_refused_naming_the_setting():
    import pytest

    from conveyor.data.api import DataError  # the CLI prints it as one line
    for bad in (1, 6, 0, 2.5, "three", True):
        with pytest.raises(DataError, match=r"^data.options.terms must be an integer from 2 to 5 "):
            synthetic_source("addition", "eval", {"terms": bad}, eval_size=4, seed=0)
    assert len(synthetic_source("addition", "eval", {"terms": "4"}, eval_size=4, seed=0)[0].info["fields"]) == 4


def test_imperfect_teacher_drops_the_carries_of_every_term():
    import random

    from conveyor.data.synthetic import sum_without_carry
    assert sum_without_carry(47, 38, 9) == "74"       # units 7+8+9=24 -> 4, tens 4+3 -> 7
    assert sum_without_carry(99, 99, 99, 99) == "66"  # 36 per column, every carry dropped
    assert sum_without_carry(10, 20, 30) == "60"      # no carry: the true sum
    src = synthetic_source("addition", "train", {"digits": 2, "terms": 3, "teacher_error": 1.0}, eval_size=10, seed=0)
    rng = random.Random(0)
    differ = 0
    for t in src.tasks[:200]:
        ops = [int(v) for v in t.info["fields"].values()]
        shown = src.demonstration(t, rng)
        assert shown == sum_without_carry(*ops) and t.answer == str(sum(ops))
        differ += shown != t.answer
    assert differ > 150  # three two-digit terms almost always carry, so the teacher is almost always wrong


def test_run_renders_every_term_and_names_the_fields_of_a_two_term_sum():
    import pytest

    from conveyor.config import load_config
    from conveyor.data.tiny import build_tokenizer
    from conveyor.run.session import SetupError, load_sources
    tok = build_tokenizer()
    cfg = load_config(None, ["data.source=synthetic:addition", "data.options={digits: 1, terms: 3}",
                             "data.prompt_template=What is {a} + {b} + {c}?", "data.eval_size=4"])
    train, held_out = load_sources(cfg, tok)
    a, b, c = held_out[0].info["fields"].values()
    assert held_out[0].prompt == f"What is {a} + {b} + {c}?" and held_out[0].answer == str(int(a) + int(b) + int(c))
    assert train[0].prompt == "What is {a} + {b} + {c}?".format(**train[0].info["fields"])
    two = load_config(None, ["data.source=synthetic:addition", "data.prompt_template=What is {a} + {b} + {c}?",
                             "data.eval_size=4"])
    with pytest.raises(SetupError, match=r"names 'c' which task 'addition' does not have; its fields: prompt, a, b"):
        load_sources(two, tok)


def _has_short_operand(task) -> bool:
    return min(len(v) for v in task.info["fields"].values()) == 1


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_short_operands_change_the_training_mix_and_never_the_held_out_sums():
    opts = {"digits": 2}
    uniform = synthetic_source("addition", "train", opts, eval_size=100, seed=0)
    held_out = synthetic_source("addition", "eval", opts, eval_size=100, seed=0)
    for share, expect in ((0.0, 0.19), (0.5, 0.47), (1.0, 0.75)):  # 1 - 0.9**2; (0.19 + 0.75) / 2; 1 - 0.5**2
        opts_s = {**opts, "short_operands": share}
        train = synthetic_source("addition", "train", opts_s, eval_size=100, seed=0)
        ev = synthetic_source("addition", "eval", opts_s, eval_size=100, seed=0)
        assert [t.prompt for t in ev.tasks] == [t.prompt for t in held_out.tasks]  # the task is unchanged
        assert len(train) == len(uniform)
        assert not {t.prompt for t in train.tasks} & {t.prompt for t in ev.tasks}
        short = sum(map(_has_short_operand, train.tasks)) / len(train)
        assert abs(short - expect) < 0.03, (share, short)  # 9,900 draws: a standard error under 0.005
        for t in train.tasks[:50]:
            a, b = (int(v) for v in t.info["fields"].values())
            assert t.answer == str(a + b) and 0 <= a <= 99 and 0 <= b <= 99
    assert [t.prompt for t in synthetic_source("addition", "train", {**opts, "short_operands": 0.0}, eval_size=100,
                                               seed=0).tasks] == [t.prompt for t in uniform.tasks]


def test_a_bad_short_operand_share_is_refused_naming_the_setting():
    import pytest

    from conveyor.data.api import DataError
    for bad in (1.5, -0.1, "many", True):
        with pytest.raises(DataError, match="data.options.short_operands must be a number in"):
            synthetic_source("addition", "train", {"digits": 2, "short_operands": bad}, eval_size=10, seed=0)
    with pytest.raises(DataError, match="short_operands is an option of synthetic:addition, not synthetic:reverse"):
        synthetic_source("reverse", "train", {"length": 4, "short_operands": 0.5}, eval_size=10, seed=0)
