"""The ``code`` reward: run a task's unit tests against the program in a completion, sandboxed.

- ``CodeReward`` (``reward.fn: code``) is a ``RewardFn``; constructing it builds the bubblewrap
  sandbox (``conveyor.sandbox``) and runs one trial program: no ``bwrap``, or limits too tight
  for the interpreter, raise ``RewardError`` naming the fix before a run starts.
- The program is ``extract_program(traj.text)``; the tests are ``traj.task.info["tests"]`` (none:
  ``MissingTests``). ONE sandbox run per trajectory runs every test, each under its own limits.
- The reward is the fraction of tests passed (or, with ``all_pass``, 1.0 only when all pass),
  with one letter per test in ``"results"``.

It knows nothing of where tasks come from or how a run uses the number; the sandbox's
guarantees (and what it does not guarantee) are in ``sandbox.py``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

from conveyor.sandbox import PythonSandbox, SandboxLimits, SandboxResult, SandboxUnavailable
from conveyor.reward.api import RewardError
from conveyor.types import Trajectory

_HARNESS = (Path(__file__).with_name("code_harness.py")).read_text(encoding="utf-8")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")
_STOPPED = {"timeout": "T", "cpu_time": "T", "memory": "M"}  # tests a stopped sandbox never reported


class MissingTests(ValueError):
    """A task has no usable ``info["tests"]``; the message names the task and the fix."""


def extract_program(text: str) -> str:
    """The program in a completion.

    The program is ``extract_program(traj.text)``: the first fenced block tagged ``python`` /
    ``py`` / ``python3`` (else the first untagged one); a block left open (the completion was
    cut at ``max_new_tokens``) runs to the end of the text; a completion without any fence is
    the program as a whole. Whitespace only: no program (``no_code``).
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    if not blocks:
        return text
    for want in (lambda tag: tag in _PYTHON_TAGS, lambda tag: tag == ""):
        for tag, body in blocks:
            if want(tag):
                return body
    return text  # only other languages' blocks: the text as a whole (it will not compile)


def task_tests(traj: Trajectory) -> list[str]:
    tests = traj.task.info.get("tests")
    if not isinstance(tests, (list, tuple)) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        got = "nothing" if tests is None else f"a {type(tests).__name__}"
        raise MissingTests(f"code reward: task {traj.task.id!r} has {got} in info['tests']; each task needs a "
                           "non-empty list of Python test snippets (e.g. \"assert add(1, 2) == 3\"): use "
                           "data.source=synthetic:code or give every data row a 'tests' list")
    return list(tests)


class CodeReward:
    """Fraction of a task's unit tests that the completion's program passes.

    ``CodeReward(all_pass=False, test_timeout_s=1.0, wall_s=4.0, memory_mb=256, unsafe=False)``
    (``reward.fn: code``, the keywords are ``reward.kwargs``) is a ``RewardFn``. Constructing it
    builds the bubblewrap sandbox (``conveyor.sandbox``) and runs one trial program through the
    harness: no ``bwrap``, or limits too tight for the interpreter, raise ``RewardError`` naming
    the fix before a run starts. ``unsafe=True`` runs programs without the sandbox (rlimits and
    the deadline only) and warns.
    - The tests are ``traj.task.info["tests"]``: a list of Python snippets (usually one
      ``assert`` each). A task without them raises ``MissingTests`` (the reward service counts it
      and gives the fallback).
    - ONE sandbox run per trajectory runs every test (``reward/code_harness.py``): each test in a
      forked child with the program's top level, at most ``test_timeout_s`` each; the whole run at
      most ``wall_s`` (keep it below ``reward.timeout_s``), all its processes together at most
      ``memory_mb`` (and each at most ``memory_mb`` of address space). A program that loops or eats
      memory fails that test (``T`` / ``M``); tests the sandbox cut off (its deadline, or its
      whole-run memory / CPU limit) get the letter of its violation.
    - Returns ``{"reward", "tests_passed", "tests_total", "all_passed", "tests_timeout",
      "tests_memory", "syntax_error", "no_code"}`` (numbers; none is named like the reward
      service's own counters, which are logged beside them as ``reward_<name>``) and ``"results"``: one letter per test (``P`` pass,
      ``F`` failed assert, ``E`` error, ``T`` timeout, ``M`` memory, ``X`` ended without a verdict,
      ``S`` syntax error, ``B`` the test does not compile, ``N`` not run: no program), plus ``"error"`` (the first failure's
      detail) and ``"stopped"`` (the sandbox's violation) when there are any. ``reward`` is
      ``tests_passed / tests_total``, or with ``all_pass=True`` 1.0 only when every test passed.
    """

    def __init__(self, all_pass: bool = False, test_timeout_s: float = 1.0, wall_s: float = 4.0,
                 memory_mb: int = 256, unsafe: bool = False) -> None:
        if not (math.isfinite(test_timeout_s) and 0 < test_timeout_s <= wall_s and math.isfinite(wall_s)):
            raise RewardError(f"code reward: test_timeout_s={test_timeout_s} and wall_s={wall_s} must be finite "
                              "with 0 < test_timeout_s <= wall_s (reward.kwargs)")
        if memory_mb < 32:
            raise RewardError(f"code reward: memory_mb={memory_mb} is below the 32 MB the interpreter needs; "
                              "raise reward.kwargs.memory_mb")
        self.all_pass, self.test_timeout_s = bool(all_pass), float(test_timeout_s)
        limits = SandboxLimits(cpu_s=max(1, math.ceil(wall_s)), memory_mb=int(memory_mb), wall_s=float(wall_s))
        try:
            self.sandbox = PythonSandbox(limits, unsafe=unsafe)
        except SandboxUnavailable as e:
            why = str(e).split(" or pass PythonSandbox(unsafe=True)")[0]  # the rest names the environment's knob
            raise RewardError(f"code reward: {why}; or set reward.kwargs.unsafe: true to run the programs "
                              "UNSANDBOXED (rlimits and a deadline only)") from None
        try:
            trial = self.run_tests("def f():\n    return 1\n", ["assert f() == 1"])
        except RuntimeError as e:
            trial = {"results": "", "error": str(e)}
        if trial["results"] != "P":
            raise RewardError(f"code reward: the sandboxed test harness failed a trial run ({trial}); raise "
                              "reward.kwargs.memory_mb / wall_s, or check that bubblewrap works on this machine")

    def __call__(self, traj: Trajectory) -> dict[str, Any]:
        tests = task_tests(traj)
        program = extract_program(traj.text)
        if not program.strip():
            return {**_summary("N" * len(tests), self.all_pass), "no_code": 1.0, "error": "no program in the completion"}
        return self.run_tests(program, tests)

    def run_tests(self, program: str, tests: Sequence[str]) -> dict[str, Any]:
        """Run ``tests`` against ``program`` in one sandbox run; the reward dict of ``CodeReward``."""
        job = json.dumps({"program": program, "tests": list(tests), "test_timeout_s": self.test_timeout_s})
        r = self.sandbox.run(_HARNESS, stdin=job)
        verdicts, done = _read_verdicts(r.stdout, len(tests))
        if not done and not verdicts and r.violation is None:
            # Neither the program's fault nor a limit: the harness itself did not run.
            raise RuntimeError(f"code reward: the test harness ended without verdicts (exit {r.exit_code}): "
                               f"{r.stderr.strip()[-300:]}")
        fill = _STOPPED.get(r.violation or "", "X")
        letters = "".join(verdicts.get(i, (fill, ""))[0] for i in range(len(tests)))
        out = _summary(letters, self.all_pass)
        failed = [(i, verdicts.get(i, (fill, f"not run: the sandbox stopped ({r.violation})"))[1])
                  for i, v in enumerate(letters) if v != "P"]
        if failed:
            i, detail = failed[0]
            out["error"] = f"test {i}: {detail or tests[i].strip()}"[:300]
        if not done:
            out["stopped"] = _stopped(r)
        return out


def _read_verdicts(stdout: str, n: int) -> tuple[dict[int, tuple[str, str]], bool]:
    verdicts: dict[int, tuple[str, str]] = {}
    done = False
    for line in stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("done") is True:
            done = True
        elif isinstance(rec.get("i"), int) and 0 <= rec["i"] < n and rec.get("v") in "PFETMXSB":
            verdicts[rec["i"]] = (str(rec["v"]), str(rec.get("d", "")))
    return verdicts, done


def _summary(letters: str, all_pass: bool) -> dict[str, Any]:
    n, k = len(letters), letters.count("P")
    reward = float(k == n and n > 0) if all_pass else (k / n if n else 0.0)
    return {"reward": reward, "tests_passed": float(k), "tests_total": float(n), "all_passed": float(k == n and n > 0),
            "tests_timeout": float(letters.count("T")), "tests_memory": float(letters.count("M")),
            "syntax_error": float(n > 0 and letters == "S" * n), "no_code": 0.0, "results": letters}


def _stopped(r: SandboxResult) -> str:
    return r.violation or f"exit code {r.exit_code}"
