"""The ``code`` reward: programs from completions, unit tests in the bubblewrap sandbox, one run each.

Real sandbox runs (bubblewrap is part of the test machine, as for tests/unit/env/test_sandbox.py);
deadlines are generous for a loaded 2-core machine, and nothing asserts speed beyond "bounded".
"""
from __future__ import annotations

import os
import secrets
import socket
import sys
import time

import pytest

from conveyor.data.code_tasks import FAMILIES, problems, reference
from conveyor.data.synthetic import synthetic_source
from conveyor.reward.api import RewardError, load_reward
from conveyor.reward.code import CodeReward, MissingTests, extract_program
from conveyor.reward.service import RewardService
from conveyor.types import Task, Trajectory

SLACK_S = 20.0
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 7) == 7"]


def traj(text: str, tests=ADD_TESTS, task_id: str = "t") -> Trajectory:
    info = {} if tests is None else {"tests": tests}
    return Trajectory(Task(task_id, "Write add(a, b).", None, info), (1,), (2,), (0.0,), (0,), (1,), text=text)


@pytest.fixture(scope="module")
def reward() -> CodeReward:
    return load_reward("code")


def test_program_extraction_rule():
    assert extract_program("Here:\n```python\ndef f():\n    return 1\n```\nIt returns 1.") == "def f():\n    return 1\n"
    assert extract_program("```bash\nls\n```\n```py\nx = 1\n```") == "x = 1\n"  # python-tagged wins
    assert extract_program("```\ny = 2\n```\n```python\nx = 1\n```") == "x = 1\n"
    assert extract_program("```\ny = 2\n```") == "y = 2\n"  # else the first untagged block
    assert extract_program("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut at max tokens
    assert extract_program("def f():\n    return 1\n") == "def f():\n    return 1\n"  # no fence: the whole text
    assert extract_program("```bash\nls\n```") == "```bash\nls\n```"  # other languages only: the whole text


def test_correct_program_passes_every_test(reward):
    out = reward(traj("Sure.\n```python\ndef add(a, b):\n    return a + b\n```\nThis adds."))
    assert out["reward"] == 1.0 and out["results"] == "PPPP"
    assert (out["tests_passed"], out["tests_total"], out["all_passed"]) == (4.0, 4.0, 1.0)
    assert "error" not in out and "stopped" not in out


def test_partly_wrong_program_scores_the_fraction_with_per_test_results(reward):
    # right for non-negative a only; the second test (-1 + 1) fails, the third raises
    text = "def add(a, b):\n    if a == 2:\n        raise ValueError('two')\n    return abs(a) + b"
    out = reward(traj(text))
    assert out["results"] == "PFEP" and out["reward"] == 0.5 and out["tests_passed"] == 2.0
    assert out["all_passed"] == 0.0
    assert out["error"] == "test 1: assert add(-1, 1) == 0"  # an assert without a message names the test
    strict = load_reward("code", {"all_pass": True})(traj(text))
    assert strict["reward"] == 0.0 and strict["results"] == "PFEP"


def test_infinite_loop_is_killed_per_test_and_never_hangs(reward):
    loop = "def add(a, b):\n    while True:\n        pass"
    t0 = time.monotonic()
    out = reward(traj(loop, ADD_TESTS[:2]))
    assert out["results"] == "TT" and out["reward"] == 0.0 and out["tests_timeout"] == 2.0
    assert "no verdict within 1s" in out["error"]
    assert time.monotonic() - t0 < 2 * 1.0 + SLACK_S
    # a loop at the top level, in C code (a huge power): the same, each test stopped at its limit
    out = reward(traj("x = 10 ** 10 ** 10\ndef add(a, b):\n    return a + b", ADD_TESTS[:1]))
    assert out["results"] == "T"


def test_sandbox_deadline_cuts_off_the_remaining_tests():
    short = CodeReward(test_timeout_s=1.0, wall_s=2.0)
    t0 = time.monotonic()
    out = short(traj("import time\ndef add(a, b):\n    time.sleep(5)", ADD_TESTS))
    assert time.monotonic() - t0 < 2.0 + SLACK_S
    assert out["results"][0] == "T" and set(out["results"]) == {"T"} and out["reward"] == 0.0
    assert out["stopped"] == "timeout"  # tests 3 and 4 never ran: the sandbox's wall deadline


def test_memory_hog_fails_with_memory(reward):
    out = reward(traj("def add(a, b):\n    return len(bytearray(2 ** 34)) + a + b", ADD_TESTS[:2]))
    assert out["results"] == "MM" and out["tests_memory"] == 2.0 and out["reward"] == 0.0


def test_memory_spread_over_forked_children_stops_the_whole_run():
    # each grandchild is well below the run's 256 MB (RLIMIT_AS of each process), the four together
    # are not: the sandbox's limit on all its processes together stops the run (test_timeout_s is
    # generous, so only a memory limit ends this test before the wall deadline)
    generous = CodeReward(test_timeout_s=60.0, wall_s=60.0, memory_mb=256)
    spread = ("import os, time\ndef add(a, b):\n    for _ in range(4):\n        r, w = os.pipe()\n"
              "        if os.fork() == 0:\n            x = bytearray(100 << 20)\n            os.write(w, b'x')\n"
              "            time.sleep(600)\n        os.read(r, 1)\n    time.sleep(600)\n")
    out = generous(traj(spread, ADD_TESTS[:2]))
    assert out["stopped"] == "memory" and out["results"] == "MM" and out["tests_memory"] == 2.0, out
    small = spread.replace("100 << 20", "20 << 20").removesuffix("    time.sleep(600)\n") + "    return a + b\n"
    assert generous(traj(small, ADD_TESTS[:2]))["results"] == "PP"  # 80 MB together fits


def test_syntax_error_and_no_code(reward):
    out = reward(traj("def add(a, b) return a + b"))
    assert out["results"] == "SSSS" and out["syntax_error"] == 1.0 and out["reward"] == 0.0
    assert out["error"].startswith("test 0: SyntaxError")
    prose = reward(traj("I cannot write that function."))
    assert prose["syntax_error"] == 1.0 and prose["reward"] == 0.0
    empty = reward(traj("```python\n\n```"))
    assert empty["no_code"] == 1.0 and empty["results"] == "NNNN" and empty["reward"] == 0.0


def test_exits_and_crashes_are_not_passes(reward):
    assert reward(traj("import os\nos._exit(0)"))["results"] == "XXXX"  # no verdict: not a pass
    assert reward(traj("import sys\nsys.exit(0)"))["results"] == "EEEE"
    out = reward(traj("def add(a, b):\n    print('x' * 10 ** 7)\n    return a + b"))
    assert out["results"] == "PPPP"  # the program's output goes nowhere; it cannot flood the harness


def test_tests_do_not_share_state(reward):
    text = "seen = []\ndef add(a, b):\n    seen.append(1)\n    assert len(seen) == 1\n    return a + b"
    assert reward(traj(text))["results"] == "PPPP"  # each test runs in a fresh process and namespace


def test_missing_or_malformed_tests_raise_a_named_error(reward):
    for tests in (None, [], "assert add(1, 2) == 3", ["assert add(1, 2) == 3", ""]):
        with pytest.raises(MissingTests, match=r"task 't' has .* info\['tests'\].*synthetic:code"):
            reward(traj("def add(a, b):\n    return a + b", tests))
    with RewardService(reward, timeout_s=10.0, fallback=-1.0, workers=1) as svc:
        [out] = svc.score([traj("def add(a, b):\n    return a + b", None)])
    assert out.reward == -1.0 and out.reward_info["reward_error"] == "raised MissingTests"
    bad_test = reward(traj("def add(a, b):\n    return a + b", ["assert add(1, 2) ==", "assert add(1, 2) == 3"]))
    assert bad_test["results"] == "BP"  # a test that does not compile is the task's fault, named apart


def test_sandbox_isolates_the_program(reward, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    target = tmp_path / f"escape-{secrets.token_hex(4)}"
    try:
        tests = [f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
                 f"open({str(target)!r}, 'w').write('x')",
                 f"open({os.path.join(sys.prefix, 'escape-' + secrets.token_hex(4))!r}, 'w').write('x')",
                 "open('/tmp/inside', 'w').write('ok')\nassert open('/tmp/inside').read() == 'ok'"]
        out = reward(traj("x = 1", tests))
    finally:
        listener.close()
    assert out["results"] == "EEEP", out  # no network, no writes outside the sandbox's own /tmp
    assert not target.exists() and os.listdir(tmp_path) == []


def test_missing_bubblewrap_stops_before_the_run(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on the PATH
    with pytest.raises(RewardError) as e:
        load_reward("code")
    msg = str(e.value)
    assert "apt-get install bubblewrap" in msg and "reward.kwargs.unsafe" in msg and "\n" not in msg


def test_bad_limits_are_refused_at_load():
    with pytest.raises(RewardError, match="test_timeout_s"):
        load_reward("code", {"test_timeout_s": 5.0, "wall_s": 2.0})
    with pytest.raises(RewardError, match="memory_mb"):
        load_reward("code", {"memory_mb": 8})


def test_many_trajectories_through_the_service_in_parallel(reward):
    texts = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b", "def add(a, b) return"] * 4
    with RewardService(reward, timeout_s=10.0, workers=3) as svc:
        outs = svc.score([traj(t, task_id=f"t{i}") for i, t in enumerate(texts)])
        assert svc.stats()["failures"] == 0 and svc.stats()["timeouts"] == 0
    assert [o.reward_info["results"] for o in outs] == ["PPPP", "FFFF", "SSSS"] * 4  # add(0, 7): 0 - 7 != 7


def test_code_tasks_source_and_references_pass_their_own_tests(reward):
    train = synthetic_source("code", "train", {}, eval_size=40, seed=0)
    held = synthetic_source("code", "eval", {}, eval_size=40, seed=0)
    assert len(held) == 40 and len(train) + len(held) == len(problems(0)) >= 120
    assert {t.prompt for t in train.tasks}.isdisjoint(t.prompt for t in held.tasks)
    assert train.default_reward == "code" and held[0].info["entry_point"] in {f.fn for f in FAMILIES}
    for task in list(train.tasks) + list(held.tasks):
        assert 3 <= len(task.info["tests"]) <= 5 and task.prompt.startswith("Write a Python function `")
        namespace: dict = {}
        exec(extract_program(task.answer), namespace)  # trusted reference code: every test passes
        for test in task.info["tests"]:
            exec(test, dict(namespace))
    # and through the sandbox, a few of them, with a wrong program failing at least one test each
    for task in held.tasks[:5]:
        good = reward(Trajectory(task, (1,), (2,), (0.0,), (0,), (1,), text=task.answer))
        assert good["reward"] == 1.0, (task.prompt, good)
        fam = next(f for f in FAMILIES if f.fn == task.info["entry_point"])
        wrong = f"def {fam.fn}({fam.args}):\n    return None\n"
        assert reward(Trajectory(task, (1,), (2,), (0.0,), (0,), (1,), text=wrong))["reward"] < 1.0
    assert reference(FAMILIES[0], {"k": 7}) == "def add_k(x):\n    return x + 7\n"
    with pytest.raises(ValueError, match="unknown code tasks"):
        synthetic_source("code", "train", {"families": ["nope"]}, eval_size=1)


def test_the_recipe_loads_and_its_limits_fit_the_service_deadline():
    from pathlib import Path

    from conveyor.config import load_config
    cfg = load_config(Path(__file__).resolve().parents[3] / "recipes" / "smollm2-code.yaml")
    assert cfg.data.source == "synthetic:code" and cfg.reward.fn == "code"
    reward = load_reward(cfg.reward.fn, cfg.reward.kwargs)  # the recipe's keywords are the reward's
    assert reward.sandbox.limits.wall_s < cfg.reward.timeout_s  # the sandbox's deadline ends a run first
    task = synthetic_source("code", "eval", {}, eval_size=cfg.data.eval_size)[0]
    text = cfg.data.prompt_template.format(prompt=task.prompt, **task.info["fields"])
    assert text.startswith(task.prompt) and text.endswith("in a ```python block.")
