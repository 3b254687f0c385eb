"""Built-in code tasks: short Python functions to write, each with unit tests (``synthetic:code``).

Contract: ``code_source(split, options, eval_size, seed, render)`` returns a task source whose
tasks ask for one function and carry its tests in ``Task.info["tests"]`` (expected values from
running the reference solution here, on seeded inputs); ``Task.answer`` is the reference
solution, and the default reward is ``code`` (``reward/code.py``). Train and eval never share a
prompt (they share families).

It knows nothing of tokenizers, sandboxes or rewards: text in, text out.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.types import Task

Inputs = Callable[[random.Random, dict], list[tuple]]
N_TESTS = 4


@dataclass(frozen=True)
class Family:
    """One kind of problem: ``fn(args)`` that returns ``text``; ``body`` is the reference body
    (both formatted with the parameters ``params`` draws); ``inputs`` draws argument tuples."""
    fn: str
    args: str
    text: str
    body: str
    inputs: Inputs
    params: tuple[dict, ...] = ({},)


def _ints(lo: int, hi: int, n: int = 1) -> Inputs:
    return lambda rng, p: [tuple(rng.randint(lo, hi) for _ in range(n)) for _ in range(N_TESTS)]


def _lists(lo: int = -9, hi: int = 20, min_len: int = 1, max_len: int = 6) -> Inputs:
    return lambda rng, p: [([rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))],)
                           for _ in range(N_TESTS)]


def _words(rng: random.Random, letters: str = "abcdeilnorst") -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))


def _strings(extra: str = "") -> Inputs:
    def draw(rng: random.Random, p: dict) -> list[tuple]:
        out = []
        for i in range(N_TESTS):
            w = _words(rng)
            if extra and i % 2 == 0:  # half the inputs surely contain what the task is about
                w = w[: len(w) // 2] + extra.format(**p) + w[len(w) // 2:]
            out.append((w,))
        return out
    return draw


def _sentences(rng: random.Random, p: dict) -> list[tuple]:
    return [(" ".join(_words(rng) for _ in range(rng.randint(1, 5))),) for _ in range(N_TESTS)]


def _palindromes(rng: random.Random, p: dict) -> list[tuple]:
    out = []
    for i in range(N_TESTS):
        w = _words(rng)
        out.append((w + w[::-1][i % 2:] if i < 2 else w + "x" + w,))
    return out


def _ks(*values: int) -> tuple[dict, ...]:
    return tuple({"k": v} for v in values)


_K = _ks(*range(2, 13))
_LETTERS = tuple({"c": c} for c in "aeiorst")
FAMILIES: tuple[Family, ...] = (
    Family("add_k", "x", "x plus {k}", "return x + {k}", _ints(-50, 50), _K),
    Family("times_k", "x", "x multiplied by {k}", "return x * {k}", _ints(-30, 30), _K),
    Family("minus_k", "x", "x minus {k}", "return x - {k}", _ints(-50, 50), _K),
    Family("power_k", "x", "x raised to the power {k}", "return x ** {k}", _ints(-4, 4), _ks(2, 3, 4, 5)),
    Family("mod_k", "x", "the remainder of x divided by {k}", "return x % {k}", _ints(0, 100), _K),
    Family("int_div_k", "x", "x divided by {k}, rounded down to an integer", "return x // {k}", _ints(0, 100), _K),
    Family("is_multiple", "n", "True if n is divisible by {k}, and False otherwise", "return n % {k} == 0",
           lambda rng, p: [(p["k"] * rng.randint(1, 9),), (p["k"] * rng.randint(1, 9) + 1,),
                           (p["k"] * rng.randint(1, 9),), (p["k"] * rng.randint(1, 9) + 1,)], _K),
    Family("count_greater", "xs", "how many numbers in the list xs are greater than {k}",
           "return sum(1 for x in xs if x > {k})", _lists(), _K),
    Family("scale_all", "xs", "a new list with every number of the list xs multiplied by {k}",
           "return [x * {k} for x in xs]", _lists(), _K),
    Family("first_k", "xs", "a list of the first {k} elements of the list xs (all of them if it is shorter)",
           "return xs[:{k}]", _lists(max_len=9), _ks(2, 3, 4, 5)),
    Family("contains_k", "xs", "True if the number {k} is in the list xs, and False otherwise", "return {k} in xs",
           lambda rng, p: [([rng.randint(0, 12) for _ in range(rng.randint(1, 6))] + ([p["k"]] if i % 2 else []),)
                           for i in range(N_TESTS)], _K),
    Family("repeat_k", "s", "the string s repeated {k} times", "return s * {k}", _strings(), _ks(2, 3, 4)),
    Family("count_char", "s", "how many times the letter '{c}' appears in the string s", "return s.count('{c}')",
           _strings("{c}"), _LETTERS),
    Family("remove_char", "s", "the string s with every letter '{c}' removed", "return s.replace('{c}', '')",
           _strings("{c}"), _LETTERS),
    Family("starts_with", "s", "True if the string s starts with the letter '{c}', and False otherwise",
           "return s.startswith('{c}')",
           lambda rng, p: [((p["c"] if i % 2 else "") + _words(rng),) for i in range(N_TESTS)], _LETTERS),
    Family("square", "x", "the square of x", "return x * x", _ints(-20, 20)),
    Family("cube", "x", "the cube of x", "return x ** 3", _ints(-9, 9)),
    Family("add", "a, b", "the sum of a and b", "return a + b", _ints(-50, 50, 2)),
    Family("subtract", "a, b", "a minus b", "return a - b", _ints(-50, 50, 2)),
    Family("multiply", "a, b", "the product of a and b", "return a * b", _ints(-12, 12, 2)),
    Family("abs_diff", "a, b", "the absolute difference between a and b", "return abs(a - b)", _ints(-50, 50, 2)),
    Family("max_of_two", "a, b", "the larger of a and b", "return max(a, b)", _ints(-50, 50, 2)),
    Family("min_of_three", "a, b, c", "the smallest of a, b and c", "return min(a, b, c)", _ints(-50, 50, 3)),
    Family("sign", "x", "1 if x is positive, -1 if x is negative and 0 if x is zero",
           "return (x > 0) - (x < 0)", lambda rng, p: [(rng.randint(1, 50),), (-rng.randint(1, 50),), (0,),
                                                        (rng.randint(-50, 50),)]),
    Family("is_even", "n", "True if n is even, and False otherwise", "return n % 2 == 0", _ints(-30, 30)),
    Family("last_digit", "n", "the last digit of the non-negative integer n", "return n % 10", _ints(0, 9999)),
    Family("digit_sum", "n", "the sum of the digits of the non-negative integer n",
           "return sum(int(d) for d in str(n))", _ints(0, 99999)),
    Family("factorial", "n", "n factorial (the product 1 * 2 * ... * n; 1 when n is 0)",
           "out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out", _ints(0, 10)),
    Family("sum_list", "xs", "the sum of the numbers in the list xs", "return sum(xs)", _lists()),
    Family("max_list", "xs", "the largest number in the non-empty list xs", "return max(xs)", _lists()),
    Family("min_list", "xs", "the smallest number in the non-empty list xs", "return min(xs)", _lists()),
    Family("count_even", "xs", "how many even numbers the list xs holds", "return sum(1 for x in xs if x % 2 == 0)",
           _lists()),
    Family("evens", "xs", "a list of the even numbers of the list xs, in their order",
           "return [x for x in xs if x % 2 == 0]", _lists()),
    Family("last_item", "xs", "the last element of the non-empty list xs", "return xs[-1]", _lists()),
    Family("reverse_list", "xs", "a new list with the elements of the list xs in reverse order", "return xs[::-1]",
           _lists()),
    Family("reverse_string", "s", "the string s reversed", "return s[::-1]", _strings()),
    Family("is_palindrome", "s", "True if the string s reads the same backwards, and False otherwise",
           "return s == s[::-1]", _palindromes),
    Family("to_upper", "s", "the string s in upper case", "return s.upper()", _strings()),
    Family("count_vowels", "s", "how many vowels (a, e, i, o, u) the string s has",
           "return sum(1 for ch in s if ch in 'aeiou')", _strings()),
    Family("word_count", "s", "the number of words in the string s (words are separated by single spaces)",
           "return len(s.split())", _sentences),
    Family("first_char", "s", "the first character of the non-empty string s", "return s[0]", _strings()),
    Family("string_length", "s", "the number of characters in the string s", "return len(s)", _strings()),
)


def reference(fam: Family, params: dict) -> str:
    """The reference solution's source."""
    return f"def {fam.fn}({fam.args}):\n    {fam.body.format(**params)}\n"


def _tests(fam: Family, params: dict, rng: random.Random) -> list[str]:
    namespace: dict[str, Any] = {}
    exec(reference(fam, params), namespace)  # our own reference code, to compute the expected values
    fn = namespace[fam.fn]
    return [f"assert {fam.fn}({', '.join(map(repr, args))}) == {fn(*[_copy(a) for a in args])!r}"
            for args in fam.inputs(rng, params)]


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def problems(seed: int = 0, families: list[str] | None = None) -> list[tuple[str, str, dict]]:
    """Every (prompt, answer, info) of the chosen families, in a seeded order."""
    known = {f.fn for f in FAMILIES}
    unknown = sorted(set(families or ()) - known)
    if unknown:
        raise ValueError(f"data.options.families names unknown code tasks {unknown}; choose among "
                         f"{', '.join(sorted(known))}")
    out = []
    for fam in FAMILIES:
        if families and fam.fn not in families:
            continue
        for params in fam.params:
            rng = random.Random(f"code-{fam.fn}-{sorted(params.items())}-{seed}")
            description = fam.text.format(**params)
            signature = f"{fam.fn}({fam.args})"
            prompt = f"Write a Python function `{signature}` that returns {description}."
            info = {"task": "code", "tests": _tests(fam, params, rng), "entry_point": fam.fn,
                    "fields": {"name": fam.fn, "signature": signature, "description": description}}
            out.append((prompt, f"```python\n{reference(fam, params)}```", info))
    random.Random(f"code-order-{seed}").shuffle(out)
    return out


@dataclass
class CodeSource:
    """The code tasks of one split (``data.api.TaskSource``)."""
    tasks: list[Task]
    default_reward: str = "code"
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def demonstration(self, task: Task, rng: random.Random) -> str | None:
        return task.answer


def code_source(split: str, options: dict | None = None, eval_size: int = 40, seed: int = 0,
                render: Callable[[str, dict], str] | None = None) -> CodeSource:
    """Contract: ``code_source(split, options, eval_size, seed, render)`` returns a task source whose
    tasks ask for one function ("Write a Python function `add_k(x)` that returns x plus 7.") and
    carry its tests in ``Task.info["tests"]``: four ``assert`` statements whose expected values come
    from running the reference solution here (trusted code) on seeded inputs. ``Task.answer`` is
    the reference solution in a ```python block (the warm start's demonstration); the default
    reward is ``code`` (``reward/code.py``), which runs the tests in the sandbox.

    Problems are drawn from the families below, most of them with a parameter (a number, a letter),
    so the same family appears with different constants; every (family, parameter) problem is
    distinct. All problems are shuffled with ``seed`` and the first ``eval_size`` are the held-out
    split, so train and eval never share a prompt (they share families). ``options.families``
    (a list of function names) keeps only those families. ``render(prompt, fields)`` gives the text
    the model sees (``data.prompt_template`` fields: ``{prompt}``, ``{name}``, ``{signature}``,
    ``{description}``).
    """
    options = dict(options or {})
    items = problems(seed, options.pop("families", None))
    if options:
        raise ValueError(f"synthetic:code has no data.options {sorted(options)}; it takes only 'families'")
    if len(items) <= eval_size:
        raise ValueError(f"synthetic:code has {len(items)} problems, not enough for data.eval_size={eval_size} "
                         "plus training; lower data.eval_size")
    part = items[:eval_size] if split == "eval" else items[eval_size:]
    tasks = []
    for i, (prompt, answer, info) in enumerate(part):
        if render is not None:
            info = {**info, "raw_prompt": prompt}
        tasks.append(Task(id=f"code-{split}-{i}", prompt=render(prompt, info["fields"]) if render else prompt,
                          answer=answer, info=info))
    return CodeSource(tasks)

