"""The advantage estimators: one table that the config, the overlap check and the batch read.

Contract: ``ESTIMATORS`` maps each ``algo.advantage`` name to its ``Estimator`` row: the function
that computes it (``compute``: a ``"module:function"`` path, imported when the first batch needs
it, or the function itself) and what the rest of a run must know of it: ``group`` (a group's
advantages need only its own rewards: groups of equal size, and a step may train its groups part
by part, ``loop.accumulate_groups``), ``critic`` (it reads the critic's values: the config asks for
``trainer.critic=true``, the batch for a values pass) and ``turn_credit`` (``algo.turn_credit=
discounted``: the turn returns centred and divided by their spread, ``"std"``, centred only,
``"mean"``, or None: not with this estimator). ``estimator(name)`` is the row, or a one-line error
naming the choices. A new estimator is one function (``conveyor.algo.advantages``: it takes an
``AdvantageInputs`` and returns the ``[B, T]`` advantages and the returns or None) and one row here.

It imports no torch: the functions are imported by the caller that computes a batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from conveyor.config.base import did_you_mean
from conveyor.plugins import resolve


@dataclass(frozen=True)
class Estimator:
    name: str
    compute: str | Callable[[Any], tuple[Any, Any]]
    group: bool = False
    critic: bool = False
    turn_credit: Literal["std", "mean"] | None = None

    def function(self) -> Callable[[Any], tuple[Any, Any]]:
        """The function that computes it (imported on the first call; Python keeps the module)."""
        return self.compute if callable(self.compute) else resolve(self.compute, f"algo.advantage={self.name}")


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("grpo", "conveyor.algo.advantages:estimate_grpo", group=True, turn_credit="std"),
    Estimator("drgrpo", "conveyor.algo.advantages:estimate_drgrpo", group=True, turn_credit="mean"),
    Estimator("rloo", "conveyor.algo.advantages:estimate_rloo", group=True),
    Estimator("reinforce++", "conveyor.algo.advantages:estimate_reinforce_pp"),
    Estimator("gae", "conveyor.algo.advantages:estimate_gae", critic=True),
)}


def estimator(name: str) -> Estimator:
    """The row of ``algo.advantage=name``."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}{did_you_mean(name, list(ESTIMATORS))}; "
                         f"use one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def group_estimators() -> list[str]:
    """The estimators whose groups' advantages need only the group's own rewards."""
    return [name for name, e in ESTIMATORS.items() if e.group]
