"""Task sources and the cursor that walks them.

- ``TaskSource``: a random-access, finite sequence of ``Task`` with a ``default_reward`` and
  ``stats``; ``ListSource`` is the plain in-memory implementation.
- ``TaskCursor(source, batch_size, seed)`` hands out batches in a seeded shuffled order, epoch
  after epoch; a resumed run continues with exactly the tasks an uninterrupted run would have seen.

This module does not read files or know any file format (``files.py`` does),
and it does not know what a reward computes.
"""
from __future__ import annotations

import random
from typing import Any, Iterator, Mapping, Protocol, Sequence, runtime_checkable

from conveyor.types import Task


class DataError(ValueError):
    """Data that cannot be used; the message names the file, the row and the fix."""


def prompt_special_tokens(data_cfg: Any) -> bool:
    """Whether prompts are tokenized with the tokenizer's special tokens (``data_cfg`` is the
    run's ``DataConfig``): not synthetic prompts (the character tokenizer maps them 1:1), not
    prompts rendered by a chat template (the template already holds them)."""
    return not data_cfg.chat_template and not data_cfg.source.startswith("synthetic:")


@runtime_checkable
class TaskSource(Protocol):
    """``TaskSource``: a random-access, finite sequence of ``Task`` with
    ``__len__`` and ``__getitem__(i)``, a ``default_reward`` (a builtin reward
    name such as ``"math"`` or a dotted path, used when ``reward.fn`` is
    ``"auto"``) and ``stats`` (integer counters about loading, e.g. ``"skipped"``
    rows). ``ListSource`` is the plain in-memory implementation.
    """
    default_reward: str
    stats: dict[str, int]

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Task: ...

    def demonstration(self, task: Task, rng: random.Random) -> str | None:
        """The answer the supervised warm start shows for ``task`` (None: it has none)."""
        ...


class ListSource:
    """An in-memory ``TaskSource`` over a list of tasks."""

    def __init__(self, tasks: Sequence[Task], default_reward: str = "math",
                 stats: Mapping[str, int] | None = None, name: str = "tasks") -> None:
        self.tasks = list(tasks)
        self.default_reward = default_reward
        self.stats = dict(stats or {})
        self.name = name

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def demonstration(self, task: Task, rng: random.Random) -> str | None:
        return task.answer

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __repr__(self) -> str:
        return f"ListSource({self.name!r}, {len(self.tasks)} tasks, default_reward={self.default_reward!r})"


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The index order of one epoch; depends only on its arguments."""
    order = list(range(size))
    if shuffle:
        # A string seed is hashed with SHA-512 by random.Random: stable across
        # processes and Python versions, unlike hash() of a tuple.
        random.Random(f"conveyor-epoch:{seed}:{epoch}").shuffle(order)
    return order


class TaskCursor:
    """Endless seeded batches over a ``TaskSource``; resumable via ``state_dict``.

    ``TaskCursor(source, batch_size, seed)`` hands out batches of tasks in a
    seeded shuffled order, epoch after epoch. Epoch ``e`` uses a permutation
    derived only from ``(seed, e)``; a batch that crosses an epoch boundary
    takes the end of one permutation and the start of the next. Its
    ``state_dict()`` is ``{"seed", "epoch", "position", "size"}``, so a resumed
    run continues with exactly the tasks an uninterrupted run would have seen.
    """

    def __init__(self, source: TaskSource, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if len(source) == 0:
            raise DataError("TaskCursor: the task source is empty; give data with at least one valid row")
        if batch_size < 1:
            raise DataError(f"TaskCursor: batch_size={batch_size} must be >= 1 (loop.batch_size)")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = epoch_order(len(source), seed, 0, shuffle)

    def next_indices(self, n: int | None = None) -> list[int]:
        """Source indices of the next ``n`` tasks (default ``batch_size``), advancing the cursor."""
        n = self.batch_size if n is None else n
        out: list[int] = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = epoch_order(len(self.source), self.seed, self.epoch, self.shuffle)
            take = min(n - len(out), len(self._order) - self.position)
            out.extend(self._order[self.position:self.position + take])
            self.position += take
        return out

    def next_batch(self, n: int | None = None) -> list[Task]:
        return [self.source[i] for i in self.next_indices(n)]

    def __iter__(self) -> Iterator[list[Task]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "size": len(self.source)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"seed", "epoch", "position", "size"} - set(state)
        if missing:
            raise DataError(f"TaskCursor state is missing {sorted(missing)}; pass a dict from state_dict()")
        if int(state["size"]) != len(self.source):
            raise DataError(f"TaskCursor state was saved for {state['size']} tasks but the source has "
                            f"{len(self.source)}; resume with the same data (path, eval_size, skip_invalid)")
        if not 0 <= int(state["position"]) <= len(self.source):
            raise DataError(f"TaskCursor state position {state['position']} is outside 0..{len(self.source)}")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = epoch_order(len(self.source), self.seed, self.epoch, self.shuffle)
