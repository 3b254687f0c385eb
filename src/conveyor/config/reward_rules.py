"""What a reward section is checked against when the config loads: a judge's templates and score
pattern, and the components of a composite reward.

- A judge's templates (``reward.judge``): ``FIELDS``, ``REQUIRED``, ``DEFAULT_TEMPLATES``,
  ``template_fields``, ``template_problem`` and ``pattern_problem``; ``reward/judge_text.py``
  re-exports them.
- Components (``reward.components``): ``Part``, ``part_name``, ``parts_of``, ``check_parts``,
  ``composite_name``, ``RESERVED`` and ``COUNTERS``; ``reward/compose.py`` and
  ``reward/calls.py`` re-export them.

Pure Python on the floor of the config: it imports nothing of conveyor, loads no reward and
knows nothing of engines.
"""
from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["pointwise", "pairwise"]

FIELDS: dict[str, frozenset[str]] = {
    "pointwise": frozenset({"prompt", "completion", "answer"}),
    "pairwise": frozenset({"prompt", "answer", "completion_a", "completion_b"}),
}
REQUIRED: dict[str, frozenset[str]] = {
    "pointwise": frozenset({"completion"}),
    "pairwise": frozenset({"completion_a", "completion_b"}),
}

DEFAULT_TEMPLATES: dict[str, str] = {
    "pointwise": (
        "Task: {prompt}\n"
        "Reference answer: {answer}\n"
        "Response: {completion}\n"
        "Judge the response. Write a short critique, then a last line \"Score: N\" "
        "with N from 0 (wrong) to 10 (correct)."
    ),
    "pairwise": (
        "Task: {prompt}\n"
        "Reference answer: {answer}\n"
        "Response A: {completion_a}\n"
        "Response B: {completion_b}\n"
        "Compare the two responses. Write a short critique, then a last line \"Score: N\" "
        "with N from 0 (B is much better) through 5 (equal) to 10 (A is much better)."
    ),
}


def template_fields(template: str) -> list[str]:
    """The field names a ``str.format`` template uses, in order (may raise ValueError)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def template_problem(template: str, mode: str) -> str | None:
    """What makes ``template`` unusable for ``mode``, or None.

    A judge's templates (``reward.judge``): ``FIELDS`` (what a template of each mode may use) and
    ``REQUIRED`` (what it must show), ``DEFAULT_TEMPLATES`` (one per mode), ``template_fields``,
    ``template_problem(template, mode)`` and ``pattern_problem(pattern)`` (what is wrong, or None).
    ``reward/judge_text.py``, the judge's text side, re-exports them.
    """
    allowed, required = FIELDS[mode], REQUIRED[mode]
    try:
        names = template_fields(template)
    except ValueError as e:
        return f"is not a format string ({e}); write literal braces as {{{{ and }}}}"
    positional = [n for n in names if n == "" or n.isdigit()]
    if positional:
        return f"has a positional field {{}}; name the fields: {', '.join(sorted(allowed))}"
    # "{prompt.x}" / "{prompt[0]}" reach into the value: only plain names are accepted.
    if any(re.search(r"[.\[]", n) for n in names):
        return f"uses attribute or index access in a field; use the plain fields {', '.join(sorted(allowed))}"
    roots = set(names)
    unknown = sorted(roots - allowed)
    if unknown:
        return (f"names unknown field(s) {', '.join('{' + u + '}' for u in unknown)}; a {mode} template "
                f"may use {', '.join('{' + a + '}' for a in sorted(allowed))}")
    missing = sorted(required - roots)
    if missing:
        return f"never shows {', '.join('{' + m + '}' for m in missing)}, so the judge cannot see what it scores"
    return None


def pattern_problem(pattern: str) -> str | None:
    """What makes a score regex unusable, or None."""
    try:
        rx = re.compile(pattern)
    except re.error as e:
        return f"is not a regular expression ({e})"
    if rx.groups < 1:
        return "has no group; put the number in parentheses, e.g. Score:\\s*(\\d+)"
    return None


COUNTERS = ("scored", "failures", "timeouts", "nonfinite")  # every reward service's (reward.calls.Ledger)

# Not a part's name: keys of a composite's own, and names whose metric (reward_<name>) the loop
# already logs (the reward's std, the service's counters).
RESERVED = ("reward", "gated", "reward_error", "std", *COUNTERS, "stuck", "batches", "worker_deaths", "restarts")


@dataclass(frozen=True)
class Part:
    """One component: what to load (``fn``, ``kwargs``), its metric ``name``, its ``weight`` in
    the total and its ``gate`` (None: no gate).

    Components (``reward.components``): ``Part(name, fn, kwargs, weight, gate)`` (a name that is
    empty, has a ``/`` or is ``RESERVED`` is refused, as is a weight or gate that is not finite),
    ``part_name(fn)`` (a part's default name), ``parts_of(components)``, ``check_parts(parts)``
    (at least one, names distinct) and ``composite_name(parts)``. ``RESERVED`` holds a composite's
    own keys and the names whose metric the loop already logs, among them ``COUNTERS``, the
    counters every reward service keeps. ``reward/compose.py`` and ``reward/calls.py`` re-export
    them.
    """
    name: str
    fn: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    gate: float | None = None

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name in RESERVED:
            raise ValueError(f"component name {self.name!r} is empty, has a '/' or is one of "
                             f"{', '.join(RESERVED)}; give the component another name")
        if not math.isfinite(self.weight) or (self.gate is not None and not math.isfinite(self.gate)):
            raise ValueError(f"component {self.name!r}: weight and gate must be finite numbers")


def composite_name(parts: Sequence[Part]) -> str:
    return "compose(" + "+".join(p.name for p in parts) + ")"


def part_name(fn: str) -> str:
    return fn.replace(":", ".").rsplit(".", 1)[-1]


def parts_of(components: Sequence[Any]) -> tuple[Part, ...]:
    """The parts of config components (objects with ``fn``, ``kwargs``, ``weight``, ``gate`` and
    ``name``, ``reward.components``); the name defaults to ``part_name(fn)``."""
    return tuple(Part(c.name or part_name(c.fn), c.fn, dict(c.kwargs), c.weight, c.gate) for c in components)


def check_parts(parts: Sequence[Part]) -> None:
    """Raise ``ValueError`` unless there is at least one part and their names are distinct."""
    if not parts:
        raise ValueError("a composite reward needs at least one component")
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"several components are named {', '.join(dup)}; give each a distinct name")
