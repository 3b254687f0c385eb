"""Rule-based verifiers: math answers, exact match, and a format check.

- ``math_reward(traj)`` compares the completion with the gold answer using math-verify and
  returns ``{"reward": 1.0 | 0.0, "parsed": 1.0 | 0.0}``; a missing or unparseable gold raises
  ``ValueError`` (a data problem, counted), never a silent 0.
- ``exact_match`` compares as strings; ``format_reward`` searches a regular expression.

They are the builtin rewards of those names (``reward/verifiers.py`` re-exports
them under their reward path, ``conveyor.reward.verifiers:math_reward``) and the
answer checks of environments (``env/tool_env.py``): a module both roles share,
below both. These functions know nothing of the reward service's deadlines;
math-verify's own timeout works on a process's main thread only (``math_reward``).
"""
from __future__ import annotations

import logging
import re
import threading

from math_verify import parse, verify

from conveyor.types import Trajectory


def _not_the_timeout_notice(record: logging.LogRecord) -> bool:
    # math-verify says once per process that its timeout is off; off the main thread it is off by
    # design here (the module docstring), and the reward service's deadline bounds the call.
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_not_the_timeout_notice)

# Thousands separators only in groups of three, so "3, 5" is two numbers, not "35".
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
DEFAULT_FORMAT_PATTERN = r"\\boxed\{.+\}"


def gold_answer(answer: str) -> str:
    """The final answer of a gold string: the text after the last ``####`` if present."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return answer.strip()


def extract_prediction(text: str) -> str | None:
    """The part of a completion to verify: the text if it has ``\\boxed``, else its last number."""
    if "\\boxed" in text:
        return text
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    # Wrapped in $...$ so math-verify reads it as LaTeX math; commas are separators.
    return "$" + numbers[-1].replace(",", "") + "$"


def math_reward(traj: Trajectory, *, float_rounding: int = 6, numeric_precision: int = 15,
                strict: bool = True, verify_timeout_s: int = 3) -> dict[str, float]:
    """1.0 if the completion's answer equals the gold mathematically.
    A parse or comparison past ``verify_timeout_s`` (whole seconds; main thread only) counts as
    no answer / not equal, as math-verify decides.

    ``math_reward(traj)`` compares the completion ``traj.text`` with the gold
    ``traj.task.answer`` using math-verify (``math_verdict(text, answer,
    task_id)``: the same over a text and a gold, an environment's check) and returns
    ``{"reward": 1.0 | 0.0, "parsed": 1.0 | 0.0}`` ("parsed" says whether any
    answer could be extracted from the completion). The prediction is the
    content of ``\\boxed{...}`` when the completion has one, otherwise the last
    number in the text. A GSM8K-style gold (``"... #### 42"``) is reduced to the
    text after the last ``####``. A task without a gold answer, or a gold that
    math-verify cannot parse, raises ``ValueError`` (a data problem the reward
    service counts and logs, rather than a silent 0).
    math-verify's own timeout (``verify_timeout_s``, per parse and per comparison)
    uses ``signal.alarm``, which only works on a process's main thread: it is on
    where ``math_reward`` runs there (the worker processes of ``reward.executor:
    process``, or a direct call) and off on any other thread (the thread
    executor), where only the service's deadline limits a call.
    """
    return math_verdict(traj.text, traj.task.answer, traj.task.id, float_rounding=float_rounding,
                        numeric_precision=numeric_precision, strict=strict, verify_timeout_s=verify_timeout_s)


def math_verdict(text: str, answer: str | None, task_id: str, *, float_rounding: int = 6,
                 numeric_precision: int = 15, strict: bool = True, verify_timeout_s: int = 3) -> dict[str, float]:
    """``math_reward`` of a completion ``text`` against the gold ``answer`` of task ``task_id``
    (what an environment checks a final answer with, no trajectory needed)."""
    if not (isinstance(verify_timeout_s, int) and verify_timeout_s >= 1):  # signal.alarm takes whole seconds
        raise ValueError(f"math reward: verify_timeout_s={verify_timeout_s!r} must be a whole number of seconds >= 1")
    # signal.alarm exists only on a process's main thread: elsewhere math-verify must not set it.
    limit = verify_timeout_s if threading.current_thread() is threading.main_thread() else None
    if answer is None or not str(answer).strip():
        raise ValueError(f"math reward: task {task_id!r} has no gold answer; "
                         "give the data an answer field or choose another reward")
    gold_text = gold_answer(str(answer))
    # A bare gold like "\sqrt{2}" is not found by math-verify without a math
    # delimiter; boxing it makes every plain gold parse the same way.
    if "\\boxed" not in gold_text:
        gold_text = "\\boxed{" + gold_text + "}"
    gold = parse(gold_text, parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math reward: cannot parse the gold answer {answer!r} "
                         f"of task {task_id!r}")
    pred_text = extract_prediction(text)
    pred = parse(pred_text, parsing_timeout=limit) if pred_text is not None else []
    if not pred:
        return {"reward": 0.0, "parsed": 0.0}
    ok = verify(gold, pred, float_rounding=float_rounding, numeric_precision=numeric_precision,
                strict=strict, timeout_seconds=limit)
    return {"reward": 1.0 if ok else 0.0, "parsed": 1.0}


def exact_match(traj: Trajectory, strip: bool = True, case_sensitive: bool = True) -> float:
    """1.0 if the completion text equals the gold answer (optionally stripped / case-folded)."""
    if traj.task.answer is None:
        raise ValueError(f"exact reward: task {traj.task.id!r} has no gold answer; "
                         "give the data an answer field or choose another reward")
    pred, gold = traj.text, str(traj.task.answer)
    if strip:
        pred, gold = pred.strip(), gold.strip()
    if not case_sensitive:
        pred, gold = pred.casefold(), gold.casefold()
    return 1.0 if pred == gold else 0.0


def format_reward(traj: Trajectory, pattern: str = DEFAULT_FORMAT_PATTERN) -> float:
    """1.0 if ``pattern`` is found anywhere in the completion (``re.search``, DOTALL).

    ``format_reward`` is 1.0 when a regular expression is found ANYWHERE in the
    completion (``re.search`` with DOTALL); anchor the pattern with ``\\A`` and
    ``\\Z`` to demand the whole completion match.
    """
    # re caches compiled patterns, so compiling per call costs a dict lookup.
    return 1.0 if re.search(pattern, traj.text, flags=re.DOTALL) else 0.0


def env_return(traj: Trajectory) -> dict:
    """The environment's own reward: the sum of its turn rewards (the default of runs with
    ``env.name``), with the episode's turns and tool calls as components, and the numbers an
    environment gave beside its reward (an agent's dict, ``env.agent``) kept."""
    calls = sum(len(t.tool_calls) for t in traj.turn_records)
    given = {k: float(v) for k, v in traj.reward_info.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "reward"}
    return {**given, "reward": traj.env_return, "turns": float(traj.turns), "tool_calls": float(calls),
            "env_errors": float(sum(1 for t in traj.turn_records if t.error))}


def number_digits(traj: Trajectory) -> dict:
    """Digit credit for an integer answer: the last integer in the completion against the gold,
    right-aligned, the share of positions that agree (a carry slip in one digit of three earns
    2/3, a missing digit costs its position). ``{"reward", "digits_exact"}``; no integer: 0.
    Meant as a dense companion of ``math`` in ``reward.components``, not alone."""
    gold = gold_answer(traj.task.answer or "").strip().replace(",", "")
    found = re.findall(r"-?\d+", traj.text.replace(",", ""))
    if not found or not re.fullmatch(r"-?\d+", gold):
        return {"reward": 0.0, "digits_exact": 0.0}
    pred = found[-1]
    n = max(len(pred), len(gold))
    score = sum(a == b for a, b in zip(pred.rjust(n), gold.rjust(n))) / n
    return {"reward": score, "digits_exact": float(pred == gold)}
