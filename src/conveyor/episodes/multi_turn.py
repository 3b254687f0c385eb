"""Multi-turn rollouts, token in / token out: one episode of engine turns and environment answers.

- ``run_episode(engine, session, task, fmt, params, limits)`` runs one episode and returns its
  ``Trajectory``: the engine continues the running token sequence itself (nothing is
  re-tokenised); policy tokens keep the engine's logprob and version, environment tokens are
  loss-masked.
- Budgets (turns, tokens, the context) cut the episode with ``finish_reason="length"``;
  ``TurnRecord``s give each turn's span, reward and tool calls.
- Failures of the environment (``env.api.EnvFailure``) propagate: the caller's failure policy
  decides.

``TurnEngine`` is what an episode needs of generation (one continuation,
awaited); it knows nothing of processes, the schedule or rewards.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from conveyor.env.api import EnvFailure, Tool
from conveyor.env.pool import EnvSession
from conveyor.types import Completion, SamplingParams, Task, Trajectory, TurnRecord

CUT_MARKER = " ...[cut]"


class TurnEngine(Protocol):
    async def generate(self, ids: list[int], params: SamplingParams) -> Completion:
        """One completion (``params.n`` is 1) continuing ``ids``."""
        ...


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_tokens: int
    max_observation_tokens: int
    context_limit: int


class TurnFormat:
    """How observations become tokens. Chat mode (a tokenizer with a chat template and
    ``chat=True``): observations are ``role`` messages rendered by the template, the first one
    with the tools; plain mode: ``template.format(observation=...)`` tokenized as is."""

    def __init__(self, tokenizer, *, chat: bool, role: str = "tool", template: str = "{observation}",
                 system_prompt: str | None = None, add_special_tokens: bool = False):
        self.tok, self.role, self.template = tokenizer, role, template
        self.chat = bool(chat and getattr(tokenizer, "chat_template", None))
        self.system_prompt, self.add_special_tokens = system_prompt, add_special_tokens
        self._turn_end = self._assistant_suffix() if self.chat else ""

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _assistant_suffix(self) -> str:
        """What the template writes after an assistant message's text (e.g. ``<|im_end|>\\n``)."""
        marker = "\x00turn\x00"
        text = self._render([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}], False)
        return text.split(marker, 1)[1] if marker in text else ""

    def first_prompt(self, observation: str, tools: Sequence[Tool]) -> list[int]:
        if not self.chat:
            return list(self.tok(observation, add_special_tokens=self.add_special_tokens)["input_ids"])
        from conveyor.env.chat import render_prompt
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
                   [{"role": "user", "content": observation}]
        return list(self.tok(render_prompt(self.tok, messages, tools), add_special_tokens=False)["input_ids"])

    def observation_ids(self, observation: str, ended_with_eos: bool, limit: int | None = None) -> list[int]:
        if limit is not None and len(observation) > 32 * limit:
            # A token is rarely over 32 characters: what lies past that is cut anyway, and a
            # megabyte observation is not worth tokenizing whole. (The marker is added by ``cut``.)
            observation = observation[: 32 * limit]
        if not self.chat:
            text = self.template.format(observation=observation)
        else:
            base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
            head = self._render(base, False)
            full = self._render(base + [{"role": self.role, "content": observation}], True)
            # The model's turn ended at its EOS (or a stop string): the template's end of an
            # assistant message, minus the EOS the model already wrote, closes the turn.
            end = self._turn_end
            eos = self.tok.eos_token or ""
            if ended_with_eos and eos and end.startswith(eos):
                end = end[len(eos):]
            text = end + full[len(head):] if full.startswith(head) else end + observation
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def cut(self, ids: list[int], limit: int, force: bool = False) -> tuple[list[int], bool]:
        """``ids`` cut to ``limit`` tokens (the marker's included) and whether they were
        (``force``: the text was already cut before tokenizing; mark it however short)."""
        if len(ids) <= limit and not force:
            return ids, False
        marker = list(self.tok(CUT_MARKER, add_special_tokens=False)["input_ids"])
        keep = max(0, min(len(ids), limit - len(marker)))
        return ids[:keep] + marker[: limit - keep], True

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


@dataclass
class _Running:
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)

    def add(self, ids, logprobs=None, versions=None, policy: bool = True) -> None:
        self.ids += ids
        self.logprobs += list(logprobs) if policy else [0.0] * len(ids)
        self.versions += list(versions) if policy else [-1] * len(ids)
        self.mask += [1 if policy else 0] * len(ids)


async def run_episode(engine: TurnEngine, session: EnvSession, task: Task, fmt: TurnFormat,
                      params: SamplingParams, limits: EpisodeLimits) -> Trajectory:
    """Contract: ``run_episode(engine, session, task, fmt, params, limits)`` runs one
    episode and returns its ``Trajectory``:
    - The prompt is the first observation (``session.reset``), rendered by
      ``TurnFormat.first_prompt`` (with the tools through the chat template
      where there is one). Each turn, the engine continues the running token
      sequence (prompt + every earlier turn and observation, the ids
      themselves: nothing is re-tokenised); the turn's text goes to
      ``session.step``; the observation's tokens (``TurnFormat.observation_ids``)
      are appended. Policy tokens keep the engine's logprob and version
      (``loss_mask`` 1); environment tokens have ``loss_mask`` 0, logprob 0.0
      and version -1.
    - Budgets: ``limits.max_turns`` model turns; ``limits.max_tokens``
      completion tokens (policy and environment together) and the engine's
      context. A turn that would pass a budget is cut there (its tokens stay
      valid samples), an observation that would is dropped, and the episode
      ends with ``finish_reason="length"``. An observation longer than
      ``limits.max_observation_tokens`` is cut with a marker and counted
      (``truncated_observation``). ``finish_reason="stop"``: the environment
      said done.
    - ``TurnRecord``s give each turn's token span, reward, tool calls, the
      environment's time and failure class. ``Trajectory.text`` is the whole
      completion decoded (observations included), what a transcript reward
      reads.
    - Failures of the environment (``env.api.EnvFailure``) propagate: the
      caller's failure policy decides (retry or drop the group).
    """
    t0 = time.perf_counter()
    prompt = fmt.first_prompt(await session.reset(task), session.tools)
    if not prompt or len(prompt) >= limits.context_limit:
        raise EnvFailure("bad_return", f"task {task.id!r}: the first observation is {len(prompt)} tokens; the "
                                       f"engine's context is {limits.context_limit}")
    run, records, finish = _Running(), [], "length"
    gen_s = env_s = 0.0
    seed = params.seed
    def room() -> int:  # completion tokens the budgets still allow
        return min(limits.max_tokens, limits.context_limit - len(prompt)) - len(run.ids)

    for turn in range(limits.max_turns):
        left = room()
        if left <= 0:
            break
        g0 = time.perf_counter()
        c = await engine.generate(prompt + run.ids, dataclasses.replace(
            params, n=1, seed=None if seed is None else seed + turn))
        gen_s += time.perf_counter() - g0
        toks = c.token_ids[:left]
        start = len(run.ids)
        run.add(toks, c.logprobs[:left], c.versions[:left])
        if len(c.token_ids) > left or (c.finish_reason == "length" and len(run.ids) >= limits.max_tokens):
            records.append(TurnRecord(start, len(run.ids)))
            break
        e0 = time.perf_counter()
        result, tools, failure = await session.step(fmt.decode(toks))
        took = time.perf_counter() - e0
        env_s += took
        records.append(TurnRecord(start, len(run.ids), float(result.reward), tools, took, failure))
        if result.done:
            finish = "stop"
            break
        if turn + 1 == limits.max_turns:
            break  # no turn follows: the last observation would only be read by nobody
        ended_with_eos = c.finish_reason == "stop" and bool(toks) and toks[-1] == fmt.tok.eos_token_id
        raw = fmt.observation_ids(result.observation, ended_with_eos, limits.max_observation_tokens)
        obs, was_cut = fmt.cut(raw, limits.max_observation_tokens,
                               force=len(result.observation) > 32 * limits.max_observation_tokens)
        if was_cut:
            session.pool.count("truncated_observation")
        if len(obs) >= room():
            break  # no room for the observation and a reply: the episode ends here
        run.add(obs, policy=False)
    return Trajectory(
        task=task, prompt_ids=tuple(prompt), completion_ids=tuple(run.ids), logprobs=tuple(run.logprobs),
        versions=tuple(run.versions), loss_mask=tuple(run.mask), text=fmt.decode(run.ids),
        finish_reason=finish, turns=len(records), turn_records=tuple(records),
        timings={"episode_s": time.perf_counter() - t0, "generate_s": gen_s, "env_s": env_s})
