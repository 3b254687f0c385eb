"""The admission rule that bounds how stale training data may be.

A rollout (one group) may START only while

    issued // batch_size <= version + max_staleness

where ``issued`` counts the groups admitted so far (before this one),
``batch_size`` is the number of groups per training step, and ``version`` is
the policy version the engines serve (the number of optimizer steps
published). With ``max_staleness = 0`` nothing for step v+1 starts until version v+1 is
published: synchronous on-policy RL. ``capacity``, ``admissible`` and ``may_admit`` are the
rule's three uses.

Pure functions only: this module knows nothing of engines, queues or time.
"""
from __future__ import annotations


def capacity(batch_size: int, max_staleness: int) -> int:
    """Groups that may be in flight at once: this step's and ``max_staleness`` steps ahead.

    ``capacity(batch_size, max_staleness)`` is how many groups the rule can
    ever have started and not yet trained: the default (and the ceiling) of
    ``loop.concurrency`` and the default size of the trajectory buffer.
    """
    return batch_size * (max_staleness + 1)


def admissible(issued: int, batch_size: int, version: int, max_staleness: int) -> int:
    """How many more groups may start now (0 when the producer must wait for new weights).

    ``admissible`` is the rule as the producer calls it; ``may_admit`` is the
    same rule as a yes/no.

    Group ``issued`` belongs to training step ``issued //
    batch_size``; it was started with weights no older than ``max_staleness``
    versions before that step.
    """
    if batch_size <= 0 or max_staleness < 0 or issued < 0 or version < 0:
        raise ValueError(f"admission: need batch_size > 0 and non-negative counts, got issued={issued}, "
                         f"batch_size={batch_size}, version={version}, max_staleness={max_staleness}")
    # The first group index that is NOT admissible: issued // batch_size <= version + max_staleness
    # holds exactly for issued < (version + max_staleness + 1) * batch_size.
    return max(0, (version + max_staleness + 1) * batch_size - issued)


def may_admit(issued: int, batch_size: int, version: int, max_staleness: int) -> bool:
    """Whether group ``issued`` may start now."""
    return admissible(issued, batch_size, version, max_staleness) > 0
