"""Several rewards as one: weighted components, gates, each component's value reported.

- ``Composite(parts)`` loads every ``Part`` and is a ``RewardFn`` returning the weighted total
  and each part's value (logged as metrics). Parts run in order; a part with a ``gate`` that
  it does not reach stops the parts after it ("format before correctness").
- A part that raises or returns no reward fails the whole composite (the exception names the
  part); a non-finite value makes the total non-finite.
- ``Part``, ``part_name``, ``parts_of``, ``check_parts``, ``composite_name`` and ``RESERVED``
  are defined in ``config/reward_rules.py`` and re-exported here.

It knows nothing of threads, processes or deadlines: the whole composite is
one reward call under the service's ``reward.timeout_s``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.config.reward_rules import RESERVED, Part, check_parts, composite_name, part_name, parts_of
from conveyor.plugins import PluginError
from conveyor.reward.api import BatchReward, load_reward
from conveyor.reward.calls import reward_value
from conveyor.types import Trajectory

__all__ = ["RESERVED", "Composite", "Part", "check_parts", "composite_name", "part_name", "parts_of"]


class Composite:
    """The ``RewardFn`` of several parts.

    - ``Part(name, fn, kwargs, weight, gate)`` says how to load one component
      (``fn`` and ``kwargs`` as ``api.load_reward`` takes them) and how it counts.
      ``Composite(parts)`` loads every part and is a ``RewardFn`` returning
      ``{"reward": total, "<name>": value, "<name>/<key>": ..., "gated": 0 | 1}``:
      the service keeps every key but ``"reward"`` in ``reward_info``, so each
      component's value is logged as a metric (``reward/<name>`` for training
      steps, ``eval_<name>`` for evaluations).
    - Order and gates: parts run in the order given. A part's value is its
      result's reward (a float, or a dict's ``"reward"``; the dict's other keys
      are kept as ``"<name>/<key>"``). ``total`` is the sum of ``weight * value``
      over the parts that ran. A part with a ``gate`` must reach it (value >=
      gate): if it does not, the parts after it are not run (absent from the
      result, so their metrics average over the trajectories that reached them)
      and the total is what the parts so far gave — "format before correctness":
      ``[format (weight 0, gate 1), math]`` is 0 for a badly formatted answer
      without ever calling the math verifier. ``"gated"`` (1 when a gate stopped
      the parts, else 0) is present when any part has a gate.
    - Failures: a part that raises, or returns something that is not a reward
      (``calls.WrongType``), fails the whole composite: the exception goes up
      with a note naming the part, and the service counts one failure and gives
      the trajectory ``reward.fallback``. A NaN or infinite value makes the total
      non-finite: counted ``nonfinite``, fallback likewise.
    - ``part_name(fn)`` is a part's default name: a builtin's name, else the last
      part of the dotted path (``pkg.mod:partial_credit`` -> ``partial_credit``).
      ``Part``, ``part_name``, ``parts_of``, ``check_parts``, ``composite_name`` and
      ``RESERVED`` (the names a part may not take) are defined in
      ``config/reward_rules.py`` (the config checks ``reward.components`` by them
      when it loads) and re-exported here.
    """

    def __init__(self, parts: Sequence[Part]) -> None:
        check_parts(parts)
        self.parts = tuple(parts)
        self.gated = any(p.gate is not None for p in parts)
        self.fns = [load_reward(p.fn, p.kwargs) for p in parts]
        for part, fn in zip(self.parts, self.fns):
            if isinstance(fn, BatchReward):
                raise PluginError(f"reward component {part.name!r} ({part.fn}) scores batches (a reward model, "
                                  "judge or remote server); components are per-trajectory rewards")
        self.__name__ = composite_name(self.parts)

    def __call__(self, traj: Trajectory) -> dict[str, Any]:
        total, out = 0.0, {}
        stopped = False
        for part, fn in zip(self.parts, self.fns):
            try:
                value, extra = reward_value(fn(traj))
            except BaseException as e:
                e.add_note(f"in reward component {part.name!r} ({part.fn})")
                raise
            out[part.name] = value
            out.update({f"{part.name}/{k}": v for k, v in extra.items()})
            total += part.weight * value
            if part.gate is not None and value < part.gate:  # NaN passes: the total is NaN, counted so
                stopped = True
                break
        if self.gated:
            out["gated"] = 1.0 if stopped else 0.0
        return {"reward": total, **out}
