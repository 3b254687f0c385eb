"""TextArena games as conveyor environments: whole games, invalid moves, seeds, tasks and data.source."""
import random
import re
import threading

import pytest

from conveyor.config import DataConfig, EnvConfig, RunConfig
from conveyor.data.api import DataError, TaskSource
from conveyor.env.api import Env, StepResult, load_env
from conveyor.env.ecosystem import TextArenaEnv, textarena_source
from conveyor.run.session import SetupError, load_sources
from conveyor.types import Task


def play_guess_the_number(env: TextArenaEnv, task: Task) -> tuple[list[int], list[StepResult]]:
    """Binary search on the game's own "higher" / "lower" hints."""
    first = env.reset(task)
    low, high = map(int, re.search(r"between (\d+) and (\d+)", first).groups())
    guesses, results = [], []
    while True:
        guess = (low + high) // 2
        guesses.append(guess)
        result = env.step(f"My guess is [{guess}].")
        results.append(result)
        if result.done:
            return guesses, results
        if "higher" in result.observation:
            low = guess + 1
        else:
            assert "lower" in result.observation
            high = guess - 1


def test_binary_search_wins_guess_the_number_with_the_win_reward():
    env = TextArenaEnv()
    assert isinstance(env, Env)
    first = env.reset(Task("g0", "", info={"seed": 11}))
    assert "Guess The Number" in first and "[5]" in first
    guesses, results = play_guess_the_number(env, Task("g0", "", info={"seed": 11}))
    assert all(r.reward == 0.0 and not r.done for r in results[:-1])
    last = results[-1]
    assert last.done and last.reward == 1.0 and sum(r.reward for r in results) == 1.0
    assert last.info["reason"].startswith("Congratulations") and last.info["invalid_move"] is False
    assert last.info["turn_count"] == len(guesses) <= 5
    assert all(f"[{g}]" not in r.observation for g, r in zip(guesses, results))  # no echo of the move


def test_a_scripted_tower_of_hanoi_solution_wins():
    env = TextArenaEnv("TowerOfHanoi-v0")
    assert "A: [3, 2, 1]" in env.reset(Task("h0", ""))
    moves = ["A C", "A B", "C B", "A C", "B A", "B C", "A C"]
    results = [env.step(f"[{m}]") for m in moves]
    assert [r.done for r in results] == [False] * 6 + [True]
    assert results[-1].reward == 1.0 and "C: [3, 2, 1]" in results[-1].observation


def test_bad_moves_get_the_games_invalid_move_handling():
    env = TextArenaEnv("GuessTheNumber-v0")
    env.reset(Task("b0", "", info={"seed": 2}))
    first = env.step("no brackets here")
    assert not first.done and first.reward == 0.0
    assert "invalid move" in first.observation.lower()
    # TextArena allows one invalid move; the second in a row ends the game
    second = env.step("still nothing")
    assert second.done and second.info["invalid_move"] is True
    assert second.reward == 0.0  # the game's own outcome: no completion yet
    with pytest.raises(RuntimeError, match="reset"):
        env.step("[3]")


def test_games_are_deterministic_per_seed_and_leave_the_callers_random_alone():
    env = TextArenaEnv()
    a = play_guess_the_number(env, Task("s", "", info={"seed": 5}))[0]
    assert play_guess_the_number(env, Task("s", "", info={"seed": 5}))[0] == a
    by_id = play_guess_the_number(env, Task("same-id", ""))[0]
    assert play_guess_the_number(TextArenaEnv(), Task("same-id", ""))[0] == by_id
    assert len({tuple(play_guess_the_number(env, Task("s", "", info={"seed": s}))[0]) for s in range(12)}) > 3
    random.seed(123)
    expected = random.random()
    random.seed(123)
    env.reset(Task("s", "", info={"seed": 9}))
    env.step("[10]")
    assert random.random() == expected


def test_concurrent_episodes_match_sequential_ones():
    def play(seed: int) -> str:
        env = TextArenaEnv("Minesweeper-v0")
        return env.reset(Task("m", "", info={"seed": seed})) + env.step("[3 3]").observation

    alone = [play(s) for s in range(6)]
    out: dict[int, str] = {}
    threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, play(s))) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [out[s] for s in range(6)] == alone


@pytest.mark.parametrize("game, move", [("Minesweeper-v0", "[2 2]"), ("Mastermind-v0", "[1 2 3 4]"),
                                        ("Sudoku-v0", "[1 1 5]"), ("FrozenLake-v0", "[down]"),
                                        ("LightsOut-v0", "[1 1]")])
def test_offline_single_player_games_start_and_answer(game, move):
    env = TextArenaEnv(game)
    assert env.reset(Task("o", "", info={"seed": 1})).strip()
    result = env.step(move)
    assert isinstance(result, StepResult) and isinstance(result.observation, str)


def test_games_that_cannot_be_played_here_are_one_line_errors():
    with pytest.raises(ValueError, match="not a single-player game"):
        TextArenaEnv("TicTacToe-v0").reset(Task("t", ""))
    with pytest.raises(ValueError, match="no game 'GuessTheNumbr-v0'.*GuessTheNumber-v0"):
        TextArenaEnv("GuessTheNumbr-v0")
    with pytest.raises(ValueError, match="env.kwargs.game"):
        TextArenaEnv("Sudoku-v0").reset(Task("t", "", info={"game": "Minesweeper-v0", "seed": 1}))
    with pytest.raises(ValueError, match="does not take env.kwargs"):
        TextArenaEnv("Sudoku-v0", nonsense=1).reset(Task("t", ""))


def test_game_kwargs_reach_the_game_and_the_builtin_name_resolves():
    env = load_env("textarena")(game="GuessTheNumber-v0", min_number=1, max_number=4, max_turns=3)
    assert "between 1 and 4" in env.reset(Task("k", "", info={"seed": 0}))


def test_textarena_source_gives_seeded_disjoint_splits():
    train = textarena_source("TowerOfHanoi-v0", "train", {"size": 50}, eval_size=10, seed=0)
    ev = textarena_source("TowerOfHanoi-v0", "eval", {"size": 50}, eval_size=10, seed=0)
    assert isinstance(train, TaskSource) and (len(train), len(ev)) == (50, 10)
    assert train.default_reward == "env" and train[0].prompt == ""
    seeds = [t.info["seed"] for t in train]
    assert len(set(seeds)) == 50 and not set(seeds) & {t.info["seed"] for t in ev}
    assert [t.info for t in textarena_source("TowerOfHanoi-v0", "train", {"size": 50}, 10, 0)] == \
        [t.info for t in train]
    assert train[3].info["game"] == "TowerOfHanoi-v0"
    # the task names the game: an environment made without one plays it
    assert "Tower of Hanoi" in TextArenaEnv().reset(train[3])
    with pytest.raises(DataError, match="no game 'Hanoi'"):
        textarena_source("Hanoi", "train", {}, 4, 0)
    with pytest.raises(DataError, match="env.kwargs"):
        textarena_source("TowerOfHanoi-v0", "train", {"num_disks": 4}, 4, 0)


def test_data_source_textarena_loads_through_the_run():
    cfg = RunConfig(data=DataConfig(source="textarena:GuessTheNumber-v0", eval_size=4, options={"size": 8}),
                    env=EnvConfig(name="textarena"))
    train, ev = load_sources(cfg, tokenizer=None)
    assert (len(train), len(ev)) == (8, 4) and train[0].info["game"] == "GuessTheNumber-v0"
    with pytest.raises(SetupError, match="env.name=textarena"):
        load_sources(RunConfig(data=DataConfig(source="textarena:GuessTheNumber-v0")), tokenizer=None)
