"""Built-in synthetic verifiable tasks that need no download.

Contract: ``synthetic_source(name, split, options, eval_size, seed)`` returns a
task source (``__len__``, ``__getitem__``, ``default_reward``) whose tasks
carry the gold answer in ``Task.answer``; train and eval splits are disjoint
by construction. Each task family has a reward with partial credit so that a
policy that is almost right gets a gradient (``partial_credit``), and ``sft_pairs`` gives the
(prompt, answer) pairs of the supervised warm-start. Tasks: ``addition``, ``reverse``,
``code`` (``synthetic_source`` says what each is); ``options.teacher_error`` makes the
warm-start's demonstrations imperfect. Tasks, evaluation and rewards always use the true answer.

This module knows nothing of tokenizers:
prompts are plain text and the tiny character tokenizer maps them 1:1.
"""
from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.data.api import DataError
from conveyor.types import Task, Trajectory

TASKS = ("addition", "reverse")


TERM_NAMES = "abcde"  # the template fields of a sum's operands, in order


def _addition(rng: random.Random, digits: int, terms: int, even_lengths: bool = False) -> tuple[str, str]:
    # operands drawn in order from one stream: two terms give the same sums as before the option existed
    if even_lengths:  # the number of digits first, even over 1..digits; then the operand
        ops = []
        for _ in range(terms):
            n = rng.randint(1, digits)
            ops.append(rng.randint(0 if n == 1 else 10 ** (n - 1), 10 ** n - 1))
    else:
        ops = [rng.randint(0, 10 ** digits - 1) for _ in range(terms)]
    return "+".join(map(str, ops)) + "=", str(sum(ops))


def _share(options: dict, key: str) -> float:
    """``options[key]`` taken out of ``options``, checked: a number in [0, 1] (default 0)."""
    value = options.pop(key, 0.0)
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = -1.0
    if isinstance(value, bool) or not 0.0 <= share <= 1.0:
        raise DataError(f"data.options.{key} must be a number in [0, 1], got {value!r}")
    return share


def _terms(options: dict) -> int:
    """``options.terms``, checked: an integer in 2..len(TERM_NAMES)."""
    value = options.get("terms", 2)
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.isdigit())
    if not whole or not 2 <= int(value) <= len(TERM_NAMES):
        raise DataError(f"data.options.terms must be an integer from 2 to {len(TERM_NAMES)} "
                         f"(operands per sum), got {value!r}")
    return int(value)


def fields(name: str, prompt: str) -> dict[str, str]:
    """The named parts of a task's prompt, for ``data.prompt_template`` (``{a}``, ``{b}``, ... of a sum,
    ``{text}`` of a string to reverse) besides ``{prompt}`` itself."""
    if name == "addition":
        ops = prompt[:-1].split("+")
        if not 2 <= len(ops) <= len(TERM_NAMES):
            raise ValueError(f"{prompt!r} is not a sum of 2 to {len(TERM_NAMES)} terms")
        return dict(zip(TERM_NAMES, ops))
    if name == "reverse":
        return {"text": prompt[len("rev:"):-1]}
    return {}


def sum_without_carry(*terms: int) -> str:
    """The classic slip: add digit by digit and drop every carry (47+38 -> 75; 47+38+9 -> 74)."""
    out, place = 0, 1
    while any(terms):
        out += (sum(t % 10 for t in terms) % 10) * place
        terms, place = tuple(t // 10 for t in terms), place * 10
    return str(out)


def _reverse(rng: random.Random, length: int) -> tuple[str, str]:
    s = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
    return f"rev:{s}=", s[::-1]


def _make(name: str, rng: random.Random, options: dict) -> tuple[str, str]:
    if name == "addition":
        return _addition(rng, int(options.get("digits", 2)), int(options.get("terms", 2)))
    if name == "reverse":
        return _reverse(rng, int(options.get("length", 5)))
    raise ValueError(f"unknown synthetic task {name!r}; choose one of {', '.join(TASKS)}, code, multiply, guess")


@dataclass
class SyntheticSource:
    """A fixed, seeded list of distinct problems of one family."""
    name: str
    tasks: list[Task]
    default_reward: str = "conveyor.data.synthetic:partial_credit"
    stats: dict = field(default_factory=dict)
    teacher_error: float = 0.0

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def demonstration(self, task: Task, rng: random.Random) -> str:
        """The answer shown by the warm-start's teacher. With ``teacher_error`` p
        the teacher is imperfect, like most real demonstration data: with
        probability p it drops the carries of a sum, of all its terms (the flawed
        answer only differs where a carry happens) or copies a string it should reverse.
        The verifier always checks the true answer, so RL can learn what
        imitation of this teacher cannot.

        ``options.teacher_error`` p makes the warm-start's demonstrations imperfect
        (``SyntheticSource.demonstration``): with probability p the teacher drops the
        carries of every column of a sum (addition) or copies the string instead of
        reversing it (reverse).
        Tasks, evaluation and rewards always use the true answer.
        """
        if self.teacher_error and rng.random() < self.teacher_error:
            parts = task.info["fields"]
            if self.name == "reverse":  # the teacher copies the string instead of reversing it
                return parts["text"]
            return sum_without_carry(*(int(v) for v in parts.values()))
        return task.answer or ""


def synthetic_source(name: str, split: str, options: dict | None = None, eval_size: int = 256,
                     seed: int = 0, train_size: int | None = None,
                     render: Callable[[str, dict], str] | None = None) -> SyntheticSource:
    """Draw distinct problems with one seeded RNG; the first ``eval_size``
    belong to the eval split, the rest (up to ``train_size``, default 20000)
    to train, so the splits never share a prompt. ``render(prompt, fields)``
    (the data section's prompt and chat templates) gives the text the model
    sees; the plain prompt and its fields stay in ``Task.info``.

    Tasks
    - ``addition``: ``"47+38="`` -> ``"85"``; operands have ``digits`` digits;
      ``terms`` (2..5, default 2) operands per sum (``"4+7+3="`` -> ``"14"``).
      ``short_operands`` s (0..1, default 0) draws that share of the TRAINING sums
      with each operand's number of digits even (1 to ``digits``, then the
      operand among the numbers of that many digits; 0-9 have one), the rest
      uniformly: with 2 digits, s = 1 puts a one-digit operand in 3 of 4
      training sums against about 1 in 5 uniformly. The held-out sums are always
      drawn uniformly (the task), and never trained on.
    - ``reverse``: ``"rev:kxqa="`` -> ``"aqxk"``; strings of ``length`` letters.
    - ``code``: Python functions with unit tests, from ``data/code_tasks.py``.

    ``data.prompt_template`` may name a task's parts (``{a}``, ``{b}`` and, with
    more ``terms``, ``{c}``, ``{d}``, ``{e}`` of a sum; ``{text}`` of a string to
    reverse) besides ``{prompt}``: the tasks of a pretrained model read as
    questions ("What is {a} + {b}?"), rendered through its chat template with
    ``data.chat_template``.
    """
    from conveyor.data.agentic import AGENTIC_TASKS, agentic_source
    if name == "code":  # functions to write, with unit tests (data/code_tasks.py)
        from conveyor.data.code_tasks import code_source
        return code_source(split, options, eval_size, seed, render)
    if name in AGENTIC_TASKS:  # multi-turn families, played by an environment
        return agentic_source(name, split, options, eval_size, seed)
    options = dict(options or {})
    train_size = int(options.pop("train_size", train_size or 20000))
    teacher_error = _share(options, "teacher_error")
    if "short_operands" in options and name != "addition":
        raise DataError(f"data.options.short_operands is an option of synthetic:addition, not synthetic:{name}; "
                         "remove it")
    short = _share(options, "short_operands")
    if name == "addition":
        options["terms"] = _terms(options)  # checked once, before any problem is drawn
    rng = random.Random(f"{name}-{seed}")
    seen: dict[str, str] = {}
    want = eval_size + train_size
    attempts = 0
    while len(seen) < want and attempts < want * 20:  # small spaces (1 digit) run out of problems
        prompt, answer = _make(name, rng, options)
        seen.setdefault(prompt, answer)
        attempts += 1
    items = list(seen.items())
    if len(items) <= eval_size:
        raise ValueError(f"synthetic task {name!r} with options {options} has only {len(items)} distinct "
                         f"problems, not enough for eval_size={eval_size} plus training; lower data.eval_size")
    part = items[:eval_size] if split == "eval" else items[eval_size:]
    if split != "eval" and short > 0:
        part = _short_mix(part, dict(items[:eval_size]), short, options, seed)
    tasks = []
    for i, (p, a) in enumerate(part):
        info = {"task": name, "fields": fields(name, p)}
        if render is not None:
            info["raw_prompt"] = p
        tasks.append(Task(id=f"{name}-{split}-{i}", prompt=render(p, info["fields"]) if render else p,
                          answer=a, info=info))
    return SyntheticSource(name, tasks, teacher_error=teacher_error)


def _short_mix(uniform: list[tuple[str, str]], held_out: dict[str, str], share: float, options: dict,
               seed: int) -> list[tuple[str, str]]:
    """As many training sums as ``uniform`` holds: each, with probability ``share``, drawn with even
    operand lengths (never a held-out sum; a sum may come more than once), else the next of the
    uniform ones in their order."""
    rng = random.Random(f"addition-short-{seed}")
    digits, terms = int(options.get("digits", 2)), int(options["terms"])
    out, i = [], 0
    while len(out) < len(uniform):
        if rng.random() < share:
            prompt, answer = _addition(rng, digits, terms, even_lengths=True)
            if prompt in held_out:
                continue
            out.append((prompt, answer))
        else:
            out.append(uniform[i])  # i < len(out) < len(uniform)
            i += 1
    return out


def sft_pairs(source) -> list[tuple[str, str]]:
    """(prompt, answer) pairs for the supervised warm-start."""
    return [(t.prompt, t.answer) for t in (source[i] for i in range(len(source)))]


def score_text(completion: str, answer: str, right_align: bool) -> float:
    pred = completion.strip()
    if not pred:
        return 0.0
    n = max(len(pred), len(answer))
    a, p = (answer.rjust(n), pred.rjust(n)) if right_align else (answer.ljust(n), pred.ljust(n))
    return sum(x == y and x != " " for x, y in zip(a, p)) / n


def partial_credit(traj: Trajectory) -> dict:
    """Reward of the built-in tasks: positionwise credit in [0, 1], plus exact match as a metric.

    Partial credit (both): the completion is compared with the answer position
    by position (right-aligned for numbers, since carries make the low digits
    easiest; left-aligned for strings); reward = matching positions /
    max(len(answer), len(completion)), so 1.0 only for an exact answer and extra
    or missing characters cost credit.
    """
    answer = traj.task.answer or ""
    right = traj.task.info.get("task") == "addition"
    r = score_text(traj.text, answer, right_align=right)
    return {"reward": r, "exact": float(traj.text.strip() == answer)}
