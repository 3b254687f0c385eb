"""Tasks and rewards from reasoning-gym's procedural datasets, used as the library ships them.

- ``reasoning_gym_source(name, split, options, eval_size, seed, render=None)``: a task source
  over the reasoning-gym dataset ``name``; tasks are deterministic for a seed, train and eval
  come from different dataset seeds (a colliding question is redrawn, else counted).
- Each task's ``info`` holds the JSON-safe address of its entry, not the entry itself.
- ``reasoning_gym_reward(traj, tag="answer", require_tag=False)``: the dataset's own score of
  the answer in the completion's last ``<answer>...</answer>``.

The package is optional (``pip install 'conveyor[envs]'``); it is imported only
when a source or the reward is used. This module knows nothing of tokenizers,
engines or how a dataset generates or judges its problems: that stays in
reasoning-gym.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import random
import threading
from typing import Any, Callable, Iterator, Mapping

from conveyor.data.api import DataError
from conveyor.types import Task, Trajectory

DEFAULT_TRAIN_SIZE = 10000
# Spare seeds tried for a train task whose question is an eval question.
_SPARE_SEEDS = 8
_REWARD = "conveyor.data.reasoning_gym:reasoning_gym_reward"


def _require() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise DataError("reasoning-gym sources need the reasoning-gym package: "
                        "pip install 'conveyor[envs]' (or pip install reasoning-gym)") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers."""
    _require()
    from reasoning_gym.factory import DATASETS
    return sorted(DATASETS)


def _check_name(name: str) -> None:
    names = dataset_names()
    if name in names:
        return
    near = difflib.get_close_matches(name, names, n=4) or ["basic_arithmetic", "leg_counting", "gsm_symbolic"]
    raise DataError(f"reasoning-gym has no dataset {name!r} (e.g. {', '.join(near)}); list all "
                    f"{len(names)} with: python -c \"import reasoning_gym.factory as f; print(sorted(f.DATASETS))\"")


def _split_seed(name: str, seed: int, split: str, attempt: int = 0) -> int:
    # reasoning-gym draws entry i from Random(seed + i): seeds next to each other would
    # share most entries, so split seeds are hashed far apart (SHA-256, stable across runs).
    digest = hashlib.sha256(f"reasoning_gym:{name}:{seed}:{split}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def _options_key(options: Mapping[str, Any]) -> str:
    return json.dumps(dict(options), sort_keys=True)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, options_key: str) -> Any:
    rg = _require()
    return rg.create_dataset(name, seed=seed, size=size, **json.loads(options_key))


@functools.lru_cache(maxsize=4096)
def _entry(name: str, seed: int, size: int, options_key: str, index: int) -> dict:
    # The n samples of a task are scored one after another: generate its entry once.
    return _dataset(name, seed, size, options_key)[index]


def _build(name: str, seed: int, size: int, options: Mapping[str, Any]) -> Any:
    """The dataset, or a DataError that names the bad option and the dataset's own."""
    try:
        return _dataset(name, seed, size, _options_key(options))
    except TypeError as e:
        from reasoning_gym.factory import DATASETS
        fields = [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.name not in ("seed", "size")]
        raise DataError(f"data.options for reasoning-gym dataset {name!r} rejected ({e}); its options are: "
                        f"size (train tasks), {', '.join(fields)}") from None
    except (AssertionError, ValueError) as e:
        raise DataError(f"data.options {dict(options)} are invalid for reasoning-gym dataset {name!r}: "
                        f"{e or 'its config validation failed'}") from None


class ReasoningGymSource:
    """Lazily generated tasks of one reasoning-gym dataset and split.

    Entries are generated on first access and kept, because a few datasets take a
    tenth of a second per problem: a run only pays for the tasks it draws."""

    default_reward = _REWARD

    def __init__(self, name: str, split: str, size: int, seed: int, options: Mapping[str, Any],
                 avoid: frozenset[str] = frozenset(), render: Callable[[str], str] | None = None) -> None:
        self.name, self.split, self.size, self.seed = name, split, size, seed
        self.options = dict(options)
        self.avoid = avoid
        self.render = render
        self.stats: dict[str, int] = {"eval_overlap": 0, "redrawn": 0} if avoid else {}
        self._tasks: dict[int, Task] = {}
        self._lock = threading.Lock()
        _build(name, _split_seed(name, seed, split), size, self.options)  # options errors surface now

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Task:
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"{self!r} has no task {i}")
        task = self._tasks.get(i)
        if task is None:
            task = self._make(i)
            with self._lock:
                task = self._tasks.setdefault(i, task)
        return task

    def __iter__(self) -> Iterator[Task]:
        return (self[i] for i in range(self.size))

    def _make(self, i: int) -> Task:
        key = _options_key(self.options)
        for attempt in range(_SPARE_SEEDS if self.avoid else 1):
            ds_seed = _split_seed(self.name, self.seed, self.split, attempt)
            _build(self.name, ds_seed, self.size, self.options)
            entry = _entry(self.name, ds_seed, self.size, key, i)
            if str(entry["question"]) not in self.avoid:
                break
        with self._lock:
            if attempt:
                self.stats["redrawn"] += 1
            if str(entry["question"]) in self.avoid:
                self.stats["eval_overlap"] += 1
        prompt = str(entry["question"])
        answer = entry.get("answer")
        return Task(id=f"rg-{self.name}-{self.split}-{i}",
                    prompt=self.render(prompt) if self.render else prompt,
                    answer=None if answer is None else str(answer),
                    info={"rg_dataset": self.name, "rg_entry": {
                        "seed": ds_seed, "size": self.size, "index": i, "options": dict(self.options)}})

    def demonstration(self, task: Task, rng: random.Random) -> str | None:
        """The oracle answer in the tags the reward reads (None where the dataset has none)."""
        return None if task.answer is None else f"<answer>{task.answer}</answer>"

    def __repr__(self) -> str:
        return f"ReasoningGymSource({self.name!r}, {self.split}, {self.size} tasks, seed={self.seed})"


@functools.lru_cache(maxsize=16)
def _eval_questions(name: str, seed: int, eval_size: int, options_key: str) -> frozenset[str]:
    eval_seed = _split_seed(name, seed, "eval")
    return frozenset(str(_entry(name, eval_seed, eval_size, options_key, i)["question"]) for i in range(eval_size))


def reasoning_gym_source(name: str, split: str, options: Mapping[str, Any] | None = None, eval_size: int = 256,
                         seed: int = 0, render: Callable[[str], str] | None = None) -> ReasoningGymSource:
    """The ``split`` ("train" or "eval") of reasoning-gym dataset ``name``.

    - ``reasoning_gym_source(name, split, options, eval_size, seed, render=None)``
      returns a task source (``__len__``, ``__getitem__``, ``default_reward``,
      ``stats``, ``demonstration``) over the reasoning-gym dataset ``name`` (any
      name of ``reasoning_gym.factory.DATASETS``). ``options["size"]`` is the
      number of training tasks (default 10000); every other option is a keyword
      of the dataset's config (difficulty ranges and the like) and is checked
      when the source is built. The eval split has ``eval_size`` tasks.
    - Train and eval are generated from different dataset seeds, both derived
      from ``(name, seed, split)``; tasks are deterministic for a seed. Small
      problem spaces repeat questions across seeds, so a train task whose
      question is also an eval question is redrawn from a spare seed (a few
      tries); one that still collides is kept and counted in
      ``stats["eval_overlap"]``.
    - Each task: ``prompt`` = the entry's ``question`` (through ``render`` if
      given: the run passes its prompt template / chat template there),
      ``answer`` = the entry's ``answer`` (None for datasets without a single
      oracle answer, e.g. ``rush_hour``: only the scorer can judge those), and
      ``info = {"rg_dataset": name, "rg_entry": {"seed", "size", "index",
      "options"}}``, the JSON-safe address of the entry, not the entry itself
      (most entries' metadata holds tuples and other values JSON would change).
    """
    _check_name(name)
    options = dict(options or {})
    for reserved in ("seed", "eval_size"):
        if reserved in options:
            raise DataError(f"data.options.{reserved} is not a reasoning-gym option here; "
                            f"set data.{'seed' if reserved == 'seed' else 'eval_size'} instead")
    size = int(options.pop("size", DEFAULT_TRAIN_SIZE))
    if split == "eval":
        return ReasoningGymSource(name, "eval", eval_size, seed, options, render=render)
    if size < 1:
        raise DataError(f"data.options.size must be at least 1 (training tasks of {name!r}), got {size}")
    avoid = frozenset()
    if eval_size:
        _build(name, _split_seed(name, seed, "eval"), eval_size, options)
        avoid = _eval_questions(name, seed, eval_size, _options_key(options))
    return ReasoningGymSource(name, "train", size, seed, options, avoid=avoid, render=render)


def reasoning_gym_reward(traj: Trajectory, *, tag: str = "answer", require_tag: bool = False) -> dict[str, float]:
    """The dataset's own score of the completion's answer.

    ``reasoning_gym_reward(traj, tag="answer", require_tag=False)`` rebuilds
    the entry from that address (datasets are cached by (name, seed, size,
    options), so a reward worker builds each at most once) and returns
    ``{"reward": dataset.score_answer(answer, entry), "tagged": 1.0 | 0.0}``.
    The answer is what the completion puts inside the LAST ``<answer>...</answer>``
    (reasoning-gym's ``extract_answer``; surrounding whitespace stripped);
    without such tags it is the whole completion, stripped (``tagged`` = 0),
    or nothing at all with ``require_tag=True``. The score is the dataset's
    own: 1.0 for a right answer and, for some datasets, partial credit. A
    scorer that raises on a malformed answer scores 0.0 with ``scorer_error``
    = 1.0. reasoning-gym's ``utils.SYSTEM_PROMPTS["default"]`` is a system
    prompt that asks for the tags (``data.system_prompt``).
    """
    info = traj.task.info
    name, ref = info.get("rg_dataset"), info.get("rg_entry")
    if not isinstance(name, str) or not isinstance(ref, Mapping):
        raise ValueError(f"reasoning_gym reward: task {traj.task.id!r} has no info['rg_dataset'] / "
                         "info['rg_entry']; use it with data.source=reasoning_gym:<name>")
    from reasoning_gym.utils import extract_answer

    key = _options_key(ref.get("options") or {})
    ds = _dataset(name, int(ref["seed"]), int(ref["size"]), key)
    # A copy: a scorer that edits its entry must not change the next sample's.
    entry = copy.deepcopy(_entry(name, int(ref["seed"]), int(ref["size"]), key, int(ref["index"])))
    answer = extract_answer(traj.text, tag_name=tag)
    tagged = answer is not None
    if answer is None and not require_tag:
        answer = traj.text.strip()
    try:
        score = float(ds.score_answer(answer, entry))
    except Exception:  # scorers parse the model's text; malformed text is a wrong answer, not a crash
        return {"reward": 0.0, "tagged": float(tagged), "scorer_error": 1.0}
    return {"reward": score, "tagged": float(tagged)}
