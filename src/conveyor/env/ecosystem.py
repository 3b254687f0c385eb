"""Multi-turn games from the TextArena library as conveyor environments, used as they ship.

- ``TextArenaEnv``: one single-player TextArena game per episode, played as player 0. The reward
  is 0.0 on every turn but the last, and TextArena's reward of player 0 on the last, unchanged;
  invalid moves are the game's business.
- ``textarena_source``: seeded tasks of one game for it; train and eval seeds are disjoint.
- Concurrent episodes stay reproducible: every call into a game runs under one lock with the
  episode's own ``random`` state swapped in.
- Games that need an API key or a corpus not on disk fail; multi-player games are refused.

This module knows nothing of tokens, engines, the pool or how a game decides its outcome: it
translates calls and messages. Why TextArena rather than ``verifiers``: see ``TextArenaEnv``.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import random
import threading
from typing import Any, Iterator, Mapping

from conveyor.env.api import StepResult
from conveyor.types import Task

DEFAULT_GAME = "GuessTheNumber-v0"
DEFAULT_TRAIN_SIZE = 10000
OFFLINE_GAMES = ("GuessTheNumber-v0", "TowerOfHanoi-v0", "Minesweeper-v0", "Mastermind-v0", "Sudoku-v0",
                 "FrozenLake-v0", "FifteenPuzzle-v0", "LightsOut-v0", "PegJump-v0", "RushHour-v0",
                 "Sokoban-v0", "Crosswords-v0", "LogicPuzzle-v0", "Secretary-v0", "Bandit-v0",
                 "Blackjack-v0", "2048-v0")

# One lock for every game's use of the process-global ``random`` (see the module docstring).
_RANDOM_LOCK = threading.Lock()


def _require() -> Any:
    try:
        import textarena
    except ImportError:
        raise ImportError("TextArena games need the textarena package: "
                          "pip install 'conveyor[envs]' (or pip install textarena)") from None
    return textarena


def game_names() -> list[str]:
    """Every game id TextArena registers (single- and multi-player, online ones included)."""
    _require()
    from textarena.envs.registration import ENV_REGISTRY
    return sorted(ENV_REGISTRY)


def check_game(game: str) -> None:
    """Raise ``ValueError`` (one line) unless ``game`` is a registered TextArena id."""
    names = game_names()
    if game in names:
        return
    near = difflib.get_close_matches(game, names, n=4) or list(OFFLINE_GAMES[:4])
    raise ValueError(f"TextArena has no game {game!r} (e.g. {', '.join(near)}); list all with: "
                     "python -c \"import textarena.envs.registration as r; print(sorted(r.ENV_REGISTRY))\"")


def task_seed(task: Task) -> int:
    """The game seed of a task: ``info["seed"]``, else a stable hash of its id."""
    seed = task.info.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    return int.from_bytes(hashlib.sha256(f"textarena:{task.id}".encode()).digest()[:4], "big")


class TextArenaEnv:
    """One single-player TextArena game per episode.

    - ``TextArenaEnv(game=None, **game_kwargs)`` plays one single-player
      TextArena game (``"GuessTheNumber-v0"`` when neither the constructor nor
      the task names one) as player 0. ``reset(task)`` makes a fresh game
      (``textarena.make``; a task's ``info["game"]``, which ``textarena_source``
      writes, names the game, so ``data.source`` alone chooses it) and seeds it
      with ``task.info["seed"]`` or, without one, a hash of ``task.id``; it
      returns the game's first observation (its rules and, for board games, the
      board). ``step(action)`` passes the model's whole turn to the game and
      returns ``StepResult(observation, reward, done, info)``; the observation
      is the game's messages since the previous turn (the echo of the model's
      own move left out, since the model already has it in its context).
    - Reward: 0.0 on every turn but the last; on the last, TextArena's reward of
      player 0, unchanged: 1.0 for a win, and for a game that ends otherwise
      (turn limit, or a second invalid move in a row) whatever the game gives,
      which for most games is the fraction of the puzzle completed in [0, 1].
      ``info`` at the end holds ``reason``, ``invalid_move`` and ``turn_count``
      from the game.
    - Invalid moves are the game's business: with TextArena's error allowance
      of one, a first bad move yields an observation that says why and the
      game goes on; a second one in a row ends it with the game's reward.
      Moves are read as the game reads them, usually the first ``[...]`` in
      the turn (the game's rules say so in the first observation).
    - Games that work offline with no API key (checked with textarena 0.7.4):
      GuessTheNumber, TowerOfHanoi, Minesweeper, Mastermind, Sudoku, FrozenLake,
      FifteenPuzzle, LightsOut, PegJump, RushHour, Sokoban, Crosswords,
      LogicPuzzle, Secretary, Bandit, Blackjack, 2048 (``-v0`` and variants).
      Word games (Wordle, Hangman, WordLadder, SpellingBee) need NLTK's
      ``words`` corpus on disk (``python -m nltk.downloader words``) and
      fail without it; games judged by an LLM need an OpenRouter key;
      multi-player games are refused (there is no opponent here).

    TextArena games draw from Python's process-global ``random`` module. So
    that concurrent episodes stay reproducible, every call into a game runs
    under one lock with the episode's own generator state swapped in and the
    caller's restored afterwards; calls into games are short, except the reset
    of a few generated puzzles (Sokoban-v0-medium takes seconds).

    Why TextArena rather than the ``verifiers`` library: TextArena installs its
    games with their data and runs them in-process behind a small
    reset/step/observe API that maps one-to-one onto ``Env``, about 45 MB
    (textarena, openai, nltk, chess). ``verifiers`` inverts control: its
    environments own the rollout loop and call the policy through an
    OpenAI-compatible client, which does not fit a token-in/token-out episode
    whose logprobs the trainer needs, and it brings about 50 packages
    (anthropic, mcp, its vendor's sandbox and tunnel clients, uvicorn). Its
    environments are mostly installed from its vendor's hub over the network,
    and its own TextArena taskset wraps this same library but only its word
    games, which download NLTK data when loaded and so fail offline.
    """

    def __init__(self, game: str | None = None, **game_kwargs: Any) -> None:
        ta = _require()
        if game is not None:
            check_game(game)
        self.game, self.game_kwargs = game, dict(game_kwargs)
        self._ta = ta
        self._env: Any = None
        self._done, self._game_id = True, ""
        self._rng_state = random.Random(0).getstate()

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        # Games call random.* directly; give them this episode's stream, keep the caller's.
        with _RANDOM_LOCK:
            outer = random.getstate()
            random.setstate(self._rng_state)
            try:
                yield
            finally:
                self._rng_state = random.getstate()
                random.setstate(outer)

    def _game_of(self, task: Task) -> str:
        wanted = task.info.get("game")
        if wanted is None:
            return self.game or DEFAULT_GAME
        if self.game is not None and wanted != self.game:
            raise ValueError(f"task {task.id!r} is a {wanted!r} game but env.kwargs.game is {self.game!r}; "
                             "drop env.kwargs.game (data.source chooses the game) or make them agree")
        check_game(wanted)
        return wanted

    def _make(self, game: str) -> Any:
        try:
            env = self._ta.make(game, **self.game_kwargs)
        except TypeError as e:
            raise ValueError(f"TextArena game {game!r} does not take env.kwargs {self.game_kwargs} ({e})") from None
        # The registry's wrappers re-send the whole history each turn and rewrite the move;
        # the bare game gives each turn's new messages and reads the model's text as written.
        while isinstance(env, self._ta.Wrapper):
            env = env.env
        return env

    def reset(self, task: Task) -> str:
        game = self._game_of(task)
        seed = task_seed(task)
        self._rng_state = random.Random(seed).getstate()
        with self._own_random():
            env = self._make(game)
            try:
                env.reset(num_players=1, seed=seed)
            except (AssertionError, ValueError) as e:
                if "player" not in str(e).lower():
                    raise
                raise ValueError(f"TextArena game {game!r} is not a single-player game ({e}); TextArenaEnv plays "
                                 f"single-player games such as {', '.join(OFFLINE_GAMES[:5])}") from None
            _, messages = env.get_observation()
        self._env, self._done, self._game_id = env, False, game
        return _render(messages)

    def step(self, action: str) -> StepResult:
        if self._env is None or self._done:
            raise RuntimeError("TextArenaEnv.step called without a running game; call reset(task) first")
        with self._own_random():
            done, step_info = self._env.step(action)
            _, messages = self._env.get_observation()
            outcome = self._env.close() if done else None
        info: dict[str, Any] = {"game": self._game_id, **dict(step_info or {})}
        if outcome is None:
            return StepResult(_render(messages), 0.0, False, info)
        self._done = True
        rewards, game_info = outcome
        player = dict((game_info or {}).get(0, {}))
        info.update(reason=str(player.get("reason", "")), invalid_move=bool(player.get("invalid_move", False)),
                    turn_count=int(player.get("turn_count", 0)))
        reward = float((rewards or {}).get(0, 0.0))
        text = _render(messages)
        return StepResult("\n".join(s for s in (text, info["reason"]) if s), reward, True, info)

    def close(self) -> None:
        self._env, self._done = None, True


def _render(messages: Any) -> str:
    """The game's messages as text, the echo of the player's own move left out."""
    ta = _require()
    out = []
    for _sender, text, kind in messages or ():
        if kind == ta.ObservationType.PLAYER_ACTION:
            continue
        out.append(str(text).strip())
    return "\n".join(s for s in out if s)


def _split_seeds(name: str, seed: int, split: str, count: int, taken: set[int]) -> list[int]:
    rng = random.Random(f"textarena:{name}:{seed}:{split}")
    seeds: list[int] = []
    while len(seeds) < count:
        s = rng.getrandbits(31)
        if s not in taken:
            taken.add(s)
            seeds.append(s)
    return seeds


def textarena_source(name: str, split: str, options: Mapping[str, Any] | None = None, eval_size: int = 256,
                     seed: int = 0):
    """Seeded tasks of TextArena game ``name`` for ``TextArenaEnv``.

    - ``textarena_source(name, split, options, eval_size, seed)``: tasks with
      ``prompt=""`` (the first observation is the prompt) and ``info =
      {"game": name, "seed": s}``; train and eval seeds are disjoint.
      ``options["size"]`` is the number of training tasks (default 10000).
      Games with few distinct boards (GuessTheNumber has 20 secrets) repeat
      boards across splits; it is the policy that is evaluated, not an answer.
    """
    from conveyor.data.api import DataError, ListSource

    try:
        check_game(name)
    except (ImportError, ValueError) as e:
        raise DataError(str(e)) from None
    options = dict(options or {})
    size = int(options.pop("size", DEFAULT_TRAIN_SIZE))
    if options:
        raise DataError(f"data.options {sorted(options)} are not options of textarena sources (only size); "
                        "pass game options as env.kwargs")
    taken: set[int] = set()
    # Eval seeds first, so they do not depend on the train size.
    eval_seeds = _split_seeds(name, seed, "eval", eval_size, taken)
    seeds = eval_seeds if split == "eval" else _split_seeds(name, seed, "train", size, taken)
    tasks = [Task(id=f"ta-{name}-{split}-{i}", prompt="", info={"game": name, "seed": s})
             for i, s in enumerate(seeds)]
    return ListSource(tasks, default_reward="env", name=f"textarena:{name}:{split}")
