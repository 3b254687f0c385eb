"""``loop.replay``: the trajectory-reuse section (``controller/replay.py`` reads it).

Off by default (``fraction`` 0). It knows nothing of how groups are stored or
weighted; ``RunConfig`` checks that the loss can correct replayed samples.
"""
from __future__ import annotations

from pydantic import Field

from conveyor.config.base import _Section


class ReplayConfig(_Section):
    """Reuse of recent high-signal groups: each step may add replayed groups to its fresh ones."""
    fraction: float = Field(0.0, ge=0.0, le=4.0, description=(
        "replayed groups added to a step, as a fraction of loop.batch_size (0.25 with batch_size 32: up to 8 "
        "stored groups trained again beside the 32 fresh ones); 0 = off. Generation per step is unchanged"))
    max_age: int = Field(2, ge=0, description=(
        "a group may be replayed while (step being trained - the oldest version of its tokens) <= this; "
        "0 = never (a group is only ever trained fresh)"))
    max_uses: int = Field(1, ge=1, description="times one group may be replayed (its fresh use not counted)")
    capacity: int = Field(256, ge=1, description=(
        "groups the store holds; past it the lowest reward spread (then the oldest) is evicted"))

    @property
    def enabled(self) -> bool:
        """Whether any group can ever be replayed (a store with max_age 0 never replays)."""
        return self.fraction > 0 and self.max_age > 0

    def per_step(self, batch_size: int) -> int:
        """Replayed groups a step may take at most."""
        return int(self.fraction * batch_size)
