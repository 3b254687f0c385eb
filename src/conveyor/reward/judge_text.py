"""The text side of a generative judge: its prompt templates, the score it writes, and how
several judgements of one item become one number.

- Templates are ``str.format`` strings checked by ``template_problem``; ``DEFAULT_TEMPLATES``
  ask for a critique ending in ``Score: N``. These, with ``pattern_problem``, are defined in
  ``config/reward_rules.py`` and re-exported here.
- ``fit_fields`` cuts the middle out of the longest fields until a prompt fits its budget.
- ``ScoreParser(pattern, low, high).parse(text)``: the LAST score, mapped onto ``[0, 1]``.
- ``aggregate(values, how)`` (``mean`` / ``vote``); ``hash_score``: the ``hash`` fallback.

Pure Python: it knows nothing of models, engines, trajectories or threads.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from conveyor.config.reward_rules import (
    DEFAULT_TEMPLATES,
    FIELDS,
    REQUIRED,
    Mode,
    pattern_problem,
    template_fields,
    template_problem,
)

__all__ = ["CUT", "DEFAULT_SCORE_PATTERN", "DEFAULT_TEMPLATES", "FIELDS", "NO_ANSWER", "REQUIRED", "Mode", "Parsed",
           "ScoreParser", "aggregate", "fit_fields", "hash_score", "pattern_problem", "template_fields",
           "template_problem"]

NO_ANSWER = "(none given)"  # what {answer} shows for a task without a reference answer
CUT = " [...] "             # what replaces the middle of a field cut to fit the judge's context
DEFAULT_SCORE_PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"


def fit_fields(render: Callable[[Mapping[str, str]], list[int]], fields: Mapping[str, str],
               shrinkable: Sequence[str], budget: int, encode: Callable[[str], list[int]],
               decode: Callable[[list[int]], str]) -> list[int] | None:
    """``render(fields)`` as token ids, with the longest ``shrinkable`` fields cut in the middle
    until the ids number at most ``budget``; None when even empty fields do not fit.

    Templates: 
    Templates are ``str.format`` strings. A pointwise template may use ``{prompt}``,
    ``{completion}`` and ``{answer}`` and must show ``{completion}``; a pairwise one may use
    ``{prompt}``, ``{answer}``, ``{completion_a}`` and ``{completion_b}`` and must show both
    completions. ``template_problem(template, mode)`` names what is wrong (unknown or missing
    field, positional field, bad braces) or returns None; ``DEFAULT_TEMPLATES`` holds one
    template per mode that asks for a short critique ending in a line ``Score: N``. These, with
    ``pattern_problem``, are defined in ``config/reward_rules.py`` (the config checks
    ``reward.judge`` by them when it loads) and re-exported here.

    ``fit_fields(render, fields, shrinkable, budget)`` renders a prompt and, when it has more
    than ``budget`` tokens, cuts the middle out of the longest shrinkable field (its head and
    tail stay, joined by ``" [...] "``) until it fits; None when even empty fields do not fit.
    """
    fields = dict(fields)
    ids = render(fields)
    for _ in range(4 * len(shrinkable) + 4):  # each round removes at least one token, or gives up
        over = len(ids) - budget
        if over <= 0:
            return ids
        tokens = {name: encode(fields[name]) for name in shrinkable}
        name = max(shrinkable, key=lambda n: len(tokens[n]))
        have = tokens[name]
        if not have:
            return None  # every shrinkable field is empty: the template alone is too long
        # Remove the overflow plus the marker's own tokens, splitting what is kept between head
        # and tail: the end of a completion (its final answer) matters as much as its start.
        keep = len(have) - over - len(encode(CUT))
        if keep <= 0:
            fields[name] = ""
        else:
            tail = keep // 2
            fields[name] = decode(have[:keep - tail]) + CUT + (decode(have[len(have) - tail:]) if tail else "")
        ids = render(fields)
    return ids if len(ids) <= budget else None


@dataclass(frozen=True)
class Parsed:
    """One judgement read: ``value`` in [0, 1], or None with ``reason`` ("no score",
    "not a number", "out of range"); ``raw`` is the matched number as written."""
    value: float | None
    reason: str = ""
    raw: str = ""


class ScoreParser:
    """``ScoreParser(pattern, low, high).parse(text)`` reads the LAST match of ``pattern`` (its
    first group) and maps the declared range ``[low, high]`` linearly onto ``[0, 1]``. It
    returns a ``Parsed`` whose ``value`` is None when there is no match, the group is not a
    number, or the number is outside the range (``reason`` says which).
    """
    def __init__(self, pattern: str = DEFAULT_SCORE_PATTERN, low: float = 0.0, high: float = 10.0) -> None:
        problem = pattern_problem(pattern)
        if problem:
            raise ValueError(f"score pattern {pattern!r} {problem}")
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"score range [{low}, {high}] must be finite with low < high")
        self.rx, self.low, self.high = re.compile(pattern), float(low), float(high)

    def parse(self, text: str) -> Parsed:
        last = None
        for last in self.rx.finditer(text):
            pass
        if last is None or last.group(1) is None:
            return Parsed(None, "no score")
        raw = last.group(1)
        try:
            x = float(raw)
        except ValueError:
            return Parsed(None, "not a number", raw)
        if not (math.isfinite(x) and self.low <= x <= self.high):
            return Parsed(None, "out of range", raw)
        return Parsed((x - self.low) / (self.high - self.low), "", raw)


def aggregate(values: Sequence[float], how: str) -> float:
    """``mean`` of ``values``, or ``vote``: the most frequent value (a tie: the tied values' mean).

    ``aggregate(values, how)``: ``mean``, or ``vote`` (the most frequent value; a tie is the
    mean of the tied values). ``hash_score(text, seed)``: a deterministic pseudo-random number
    in ``[0, 1)`` from a completion's text and a seed (the fallback ``hash``).
    """
    if not values:
        raise ValueError("aggregate of no values")
    if how == "mean":
        return sum(values) / len(values)
    if how == "vote":
        counts = Counter(values)
        top = max(counts.values())
        tied = [v for v, c in counts.items() if c == top]
        return sum(tied) / len(tied)
    raise ValueError(f"aggregate {how!r} is not one of mean, vote")


def hash_score(text: str, seed: int) -> float:
    """A pseudo-random number in [0, 1) fixed by ``text`` and ``seed``."""
    h = hashlib.blake2b(f"{seed}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0 ** 64
