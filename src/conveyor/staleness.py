"""The admission rule that bounds how stale training data may be.

A rollout (one group) may START only while

    issued // batch_size <= version + max_staleness

where ``issued`` counts the groups admitted so far (before this one),
``batch_size`` is the number of groups per training step, and ``version`` is
the policy version the engines serve (the number of optimizer steps
published). Group ``issued`` belongs to training step ``issued //
batch_size``; it was started with weights no older than ``max_staleness``
versions before that step. With ``max_staleness = 0`` nothing for step v+1
starts until version v+1 is published: synchronous on-policy RL.

Pure functions only: this module knows nothing of engines, queues or time.
"""
from __future__ import annotations


def may_admit(issued: int, batch_size: int, version: int, max_staleness: int) -> bool:
    if batch_size <= 0 or max_staleness < 0 or issued < 0 or version < 0:
        raise ValueError(f"may_admit: need batch_size > 0 and non-negative counts, got issued={issued}, "
                         f"batch_size={batch_size}, version={version}, max_staleness={max_staleness}")
    return issued // batch_size <= version + max_staleness


def admissible(issued: int, batch_size: int, version: int, max_staleness: int) -> int:
    """How many more groups may start now (0 when the producer must wait for new weights)."""
    limit = (version + max_staleness + 1) * batch_size  # first group index that is NOT admissible
    return max(0, limit - issued)
