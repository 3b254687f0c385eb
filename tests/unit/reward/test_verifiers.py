"""Values of the rule verifiers, and reward lookup by name."""
import subprocess
import sys
import threading

import pytest

from conveyor.plugins import PluginError
from conveyor.reward.api import BUILTIN_REWARDS, load_reward, reward_name
from conveyor.reward.verifiers import exact_match, extract_prediction, format_reward, gold_answer, math_reward
from conveyor.types import Task, Trajectory


def traj(text: str, answer: str | None = "42", task_id: str = "t0") -> Trajectory:
    return Trajectory(Task(task_id, "q", answer), (1,), (), (), (), (), text=text)


@pytest.mark.parametrize("text, answer, reward, parsed", [
    ("so the answer is \\boxed{42}", "42", 1.0, 1.0),
    ("\\boxed{1/2}", "0.5", 1.0, 1.0),
    ("the result is 0.5", "1/2", 1.0, 1.0),
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0, 1.0),
    ("\\boxed{41}", "42", 0.0, 1.0),
    ("I get 12 then 40 + 2 = 42.", "42", 1.0, 1.0),   # last number wins
    ("42 first, then 41", "42", 0.0, 1.0),
    ("She pays $1,000 in total.", "Step one... #### 1,000", 1.0, 1.0),
    ("no idea", "42", 0.0, 0.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0, 1.0),
])
def test_math_reward_values(text, answer, reward, parsed):
    assert math_reward(traj(text, answer)) == {"reward": reward, "parsed": parsed}


def test_math_reward_without_gold_raises_naming_task():
    with pytest.raises(ValueError, match="task 'x7' has no gold answer"):
        math_reward(traj("\\boxed{1}", None, task_id="x7"))


def test_math_reward_works_off_the_main_thread_and_says_nothing_of_its_timeout():
    # A fresh interpreter: math-verify's notice that its timeout is off comes once per process.
    code = ("import logging, threading\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "from conveyor.reward.verifiers import math_reward\n"
            "from conveyor.types import Task, Trajectory\n"
            "t = Trajectory(Task('t0', 'q', '42'), (1,), (), (), (), (), text='\\\\boxed{42}')\n"
            "out = []\n"
            "th = threading.Thread(target=lambda: out.append(math_reward(t)))\n"
            "th.start(); th.join(60)\n"
            "print(out)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[{'reward': 1.0, 'parsed': 1.0}]", r.stderr
    assert "Timeout is disabled" not in r.stderr, r.stderr


def test_gold_and_prediction_extraction():
    assert gold_answer("48 / 2 = 24 clips\n#### 24") == "24"
    assert gold_answer(" 7 ") == "7"
    assert extract_prediction("a 3, 5 and 1,200 apples") == "$1200$"
    assert extract_prediction("x \\boxed{3}") == "x \\boxed{3}"
    assert extract_prediction("nothing") is None


def test_exact_match_values():
    assert exact_match(traj(" 42\n")) == 1.0
    assert exact_match(traj(" 42\n"), strip=False) == 0.0
    assert exact_match(traj("Paris", "paris")) == 0.0
    assert exact_match(traj("Paris", "paris"), case_sensitive=False) == 1.0


def test_format_reward_uses_search_with_dotall():
    assert format_reward(traj("work\nthen \\boxed{7} done")) == 1.0
    assert format_reward(traj("7")) == 0.0
    assert format_reward(traj("<think>a\nb</think> 7"), pattern=r"<think>.+</think>") == 1.0
    assert format_reward(traj("x <think>a</think>"), pattern=r"\A<think>.+</think>\Z") == 0.0


def test_load_reward_builtins_and_kwargs():
    assert set(BUILTIN_REWARDS) == {"math", "exact", "format", "env", "code", "digits"}
    assert load_reward("math", {}) is math_reward
    fn = load_reward("exact", {"case_sensitive": False})
    assert fn(traj("PARIS", "paris")) == 1.0
    assert reward_name(fn) == "exact_match"
    assert load_reward("conveyor.reward.verifiers:format_reward", {}) is format_reward


def test_load_reward_rejects_unknown_kwargs_and_names():
    with pytest.raises(PluginError, match=r"does not accept reward.kwargs \['strip_all'\].*strip, case_sensitive"):
        load_reward("exact", {"strip_all": True})
    with pytest.raises(PluginError, match="is not a builtin"):
        load_reward("maths", {})


def test_math_reward_alarm_on_the_main_thread_and_whole_seconds_only():
    # On the main thread math-verify's own alarm bounds a comparison that would run for minutes
    # (the thread executor never gets here: off the main thread no alarm is set, see above).
    assert math_reward(traj("\\boxed{9^{9^{9}}}"), verify_timeout_s=1) == {"reward": 0.0, "parsed": 1.0}
    with pytest.raises(ValueError, match="verify_timeout_s=1.5 must be a whole number of seconds"):
        math_reward(traj("\\boxed{42}"), verify_timeout_s=1.5)


def test_digit_credit_scores_the_last_integer_digit_by_digit():
    from conveyor.reward.verifiers import number_digits

    def score(text, answer="130"):
        return number_digits(traj(text, answer))
    assert score("48 + 82 = 130") == {"reward": 1.0, "digits_exact": 1.0}
    assert score("48 + 82 = 120")["reward"] == pytest.approx(2 / 3)  # one carry slip
    assert score("the answer is 30")["reward"] == pytest.approx(2 / 3)  # a missing digit costs its place
    assert score("1,130")["reward"] == pytest.approx(3 / 4)
    assert score("no number") == {"reward": 0.0, "digits_exact": 0.0}
    assert score("12", answer="#### 12")["digits_exact"] == 1.0
