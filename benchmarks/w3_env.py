"""W3's environment: a slow tool with seeded log-normal latency, random-token observations, a hash reward.

Contract
- ``LatencyEnv(turns=4, median_s=0.3, sigma=SIGMA, obs_tokens=32, seed=0,
  reward_seed=0, tokenizer=None, per_episode=True, log_path=None)`` is a
  conveyor ``Env`` (``env.name=benchmarks.w3_env:LatencyEnv``, the factory
  called with ``env.kwargs``):
  - ``reset(task)`` returns None: the first observation is the task's prompt.
  - Each ``step(action)`` sleeps a latency drawn from a log-normal with median
    ``median_s`` and log-sd ``sigma`` (default ``ln(2 / 0.3) / 2.326``: p99
    about 2 s at median 0.3 s), from a stream seeded by ``(seed, task id,
    episode index, turn)``, so every configuration sees the same latencies.
    The episode index counts the resets of that task id in this process
    (0..n-1 for a group of n): each episode of a group has latencies of its
    own, and a group's set of latency sequences is the same in every
    configuration (which episode draws which one depends on arrival order).
    ``per_episode=False`` keys the stream by ``(seed, task id, turn)`` alone
    (every episode of a group waits the same).
  - Its observation is ``obs_tokens`` random token ids written as text that
    ``tokenizer`` maps back to exactly those ids (``observation_vocab``: the
    tokenizer's space-led alphabetic words that are one token each, e.g. the
    W1 word tokenizer's `` ab``; else its single alphanumeric characters,
    e.g. the tiny character-level tokenizer; checked at construction).
    ``tokenizer``: a checkpoint directory (``AutoTokenizer``) or ``"tiny"``
    (``conveyor.data.tiny.build_tokenizer``); loaded once per process.
  - Reward 0 until step ``turns``, which returns the seeded hash of the
    episode (``rewards.hash_score`` of the concatenated action texts, seed
    ``reward_seed``), an empty observation and ``done=True``.
  - ``log_path``: one JSON line per step drawn (task, episode, turn,
    latency_s), the draws behind W3's environment-latency columns.
- ``conveyor_env_return(traj, log_path)``: the run's reward (the env's
  return, as ``env_return`` gives it), recording one line per trajectory
  like ``rewards.conveyor_hash`` does plus the multi-turn fields: policy
  tokens, each turn's policy tokens and the environment's measured seconds.
- ``check_observation_roundtrip(tokenizer, obs_tokens)`` raises unless
  observations tokenize back to exactly ``obs_tokens`` ids.

It knows nothing of engines or the loop: text in, text out, one sleep a step.
"""
from __future__ import annotations

import math
import random
import threading
import time
from typing import Any

from benchmarks.rewards import _conveyor_row, hash_score, record

MEDIAN_S = 0.3
P99_S = 2.0
Z99 = 2.326  # the standard normal's 99th percentile
SIGMA = math.log(P99_S / MEDIAN_S) / Z99  # ~0.816


def sigma_for(median_s: float, p99_s: float) -> float:
    """Log-sd of the log-normal with this median and 99th percentile."""
    return math.log(p99_s / median_s) / Z99


def latency(seed: int, task_id: str, episode: int | None, turn: int, median_s: float, sigma: float) -> float:
    """The seeded draw of one environment step (seconds)."""
    key = f"w3-latency:{seed}:{task_id}:{'-' if episode is None else episode}:{turn}"
    return random.Random(key).lognormvariate(math.log(median_s), sigma)


# ----- observations: token ids as text the tokenizer maps back 1:1 ----------------------------------
_LOCK = threading.Lock()
_TOKENIZERS: dict[str, Any] = {}
_VOCABS: dict[tuple[str, int], tuple[list[int], list[str]]] = {}


def load_tokenizer(spec: str):
    """A tokenizer by checkpoint directory, or ``"tiny"`` for conveyor's character-level one (cached)."""
    with _LOCK:
        if spec not in _TOKENIZERS:
            if spec == "tiny":
                from conveyor.data.tiny import build_tokenizer
                _TOKENIZERS[spec] = build_tokenizer()
            else:
                from transformers import AutoTokenizer
                _TOKENIZERS[spec] = AutoTokenizer.from_pretrained(spec)
        return _TOKENIZERS[spec]


def _single(tok, i: int) -> str | None:
    s = tok.decode([i])
    return s if s and list(tok(s, add_special_tokens=False)["input_ids"]) == [i] else None


def observation_vocab(tok, want: int = 4096, scan: int = 60000, seed: int = 0) -> tuple[list[int], list[str]]:
    """Token ids and their texts that concatenate to text tokenizing back to the same ids.

    Space-led alphabetic words (`` ab``) when the tokenizer has at least 64 of them (a
    pre-tokenizer that splits at spaces keeps each one whole); else single alphanumeric
    characters (a character-level tokenizer keeps any concatenation of them apart). At most
    ``scan`` ids are examined, in a seeded random order, stopping at ``want`` words."""
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    random.Random(seed).shuffle(ids)
    words: list[tuple[int, str]] = []
    chars: list[tuple[int, str]] = []
    for i in ids[:scan]:
        s = _single(tok, i)
        if s is None:
            continue
        if len(s) > 1 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
            words.append((i, s))
            if len(words) >= want:
                break
        elif len(s) == 1 and s.isascii() and s.isalnum():
            chars.append((i, s))
    chosen = words if len(words) >= 64 else chars
    if len(chosen) < 2:
        raise ValueError(f"{type(tok).__name__}: found no set of single-token words or characters to write "
                         "observations with")
    chosen.sort()
    return [i for i, _ in chosen], [s for _, s in chosen]


def vocab_of(spec: str) -> tuple[list[int], list[str]]:
    tok = load_tokenizer(spec)
    with _LOCK:
        key = (spec, len(tok))
        if key not in _VOCABS:
            _VOCABS[key] = observation_vocab(tok)
        return _VOCABS[key]


def check_observation_roundtrip(tokenizer: str, obs_tokens: int, samples: int = 16, seed: int = 0) -> None:
    """Raise unless random observations of ``obs_tokens`` ids tokenize back to exactly those ids."""
    tok = load_tokenizer(tokenizer)
    ids, texts = vocab_of(tokenizer)
    rng = random.Random(seed)
    for _ in range(samples):
        pick = [rng.randrange(len(ids)) for _ in range(obs_tokens)]
        text = "".join(texts[k] for k in pick)
        got = list(tok(text, add_special_tokens=False)["input_ids"])
        if got != [ids[k] for k in pick]:
            raise RuntimeError(f"{type(tok).__name__} of {tokenizer}: an observation of {obs_tokens} ids "
                               f"tokenizes to {len(got)} other ids ({text[:60]!r}...)")


# ----- the environment ----------------------------------------------------------------------------
_EPISODES: dict[str, int] = {}  # resets per task id in this process (the episode index)


def _next_episode(task_id: str) -> int:
    with _LOCK:
        k = _EPISODES.get(task_id, 0)
        _EPISODES[task_id] = k + 1
        return k


class LatencyEnv:
    """W3's environment (see the module docstring)."""

    def __init__(self, turns: int = 4, median_s: float = MEDIAN_S, sigma: float = SIGMA, obs_tokens: int = 32,
                 seed: int = 0, reward_seed: int = 0, tokenizer: str | None = None, per_episode: bool = True,
                 log_path: str | None = None):
        if tokenizer is None:
            raise ValueError("LatencyEnv needs tokenizer=<checkpoint directory> (or 'tiny') to write observations "
                             "that tokenize back to exactly obs_tokens ids")
        if turns < 1 or obs_tokens < 0 or median_s < 0 or sigma < 0:
            raise ValueError(f"LatencyEnv: turns ({turns}) >= 1, obs_tokens ({obs_tokens}), median_s ({median_s}) "
                             f"and sigma ({sigma}) >= 0")
        self.turns, self.median_s, self.sigma, self.obs_tokens = int(turns), float(median_s), float(sigma), obs_tokens
        self.seed, self.reward_seed, self.per_episode, self.log_path = seed, reward_seed, per_episode, log_path
        self.ids, self.texts = vocab_of(tokenizer)
        self.task_id, self.episode, self.actions = "", 0, []

    def reset(self, task) -> None:
        self.task_id = task.id
        self.episode = _next_episode(task.id) if self.per_episode else None
        self.actions = []
        return None  # the task's prompt

    def step(self, action: str):
        from conveyor.env.api import StepResult
        turn = len(self.actions)
        self.actions.append(action)
        wait = latency(self.seed, self.task_id, self.episode, turn, self.median_s, self.sigma) \
            if self.median_s > 0 else 0.0
        time.sleep(wait)
        record(self.log_path, [{"task": self.task_id, "episode": self.episode, "turn": turn, "latency_s": wait}])
        if len(self.actions) >= self.turns:
            return StepResult("", hash_score("".join(self.actions), self.reward_seed), True)
        rng = random.Random(f"w3-obs:{self.seed}:{self.task_id}:{self.episode}:{turn}")
        text = "".join(self.texts[rng.randrange(len(self.texts))] for _ in range(self.obs_tokens))
        return StepResult(text, 0.0, False)


def conveyor_env_return(traj, log_path: str | None = None) -> dict:
    """The environment's return as the run's reward, one recorded line per trajectory (W3)."""
    from conveyor.reward.verifiers import env_return
    out = env_return(traj)
    recs = traj.turn_records
    row = _conveyor_row(traj, out["reward"])
    row.update({"policy_len": int(sum(traj.loss_mask)), "turns": traj.turns,
                "turn_lens": [r.end - r.start for r in recs],  # policy tokens of each turn
                "env_s": [r.env_s for r in recs if r.env_s > 0],  # measured; a turn cut by a budget has none
                "env_errors": out["env_errors"]})
    record(log_path, [row])
    return out
