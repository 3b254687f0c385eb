"""One episode's model calls recorded as one token sequence: the rendered history is matched, not re-tokenised.

- ``Transcript(limits, decode, text)`` records the calls of one episode that a client (an agent)
  makes through the OpenAI-compatible endpoint: each call's rendered request must continue the
  recorded sequence (``match_prefix``); only the new suffix is appended, loss-masked, and the
  engine continues the recorded ids themselves.
- A call that does not continue the record is a rewrite: counted, still served, and the episode
  is refused for training (``EnvFailure("history_rewritten")``): an episode is trained only as
  one exact sequence, never silently on tokens the model did not see.

It knows no HTTP, no engine and no agent: token ids in, a ``Trajectory`` out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from conveyor.env.api import EnvFailure
from conveyor.episodes.multi_turn import EpisodeLimits
from conveyor.types import Completion, Task, Trajectory, TurnRecord


@dataclass(frozen=True)
class Span:
    """A completion's tokens in the recorded sequence ``[start, end)``; ``stop``: its last token
    when that token is a stop token (EOS), which a chat template may not write back."""
    start: int
    end: int
    stop: int | None = None


@dataclass
class _Segment:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)  # positions in prompt + ids
    records: list[TurnRecord] = field(default_factory=list)

    @property
    def recorded(self) -> list[int]:
        return self.prompt + self.ids


def match_prefix(recorded: Sequence[int], spans: Sequence[Span], new: Sequence[int],
                 decode: Callable[[Sequence[int]], str]) -> int | None:
    """How many tokens of ``new`` the ``recorded`` sequence covers, or None if ``new`` does not
    continue it (``Transcript`` gives the rules)."""
    i = j = 0
    for span in list(spans) + [Span(len(recorded), len(recorded))]:
        fixed = recorded[i:span.start]  # tokens the policy did not produce: equal, token by token
        if list(new[j:j + len(fixed)]) != list(fixed):
            return None
        j += len(fixed)
        body = list(recorded[span.start:span.end])
        if span.stop is not None:
            body = body[:-1]
        if list(new[j:j + len(body)]) == body:
            j += len(body)
        else:
            k = _same_text(body, new, j, decode)
            if k is None:
                return None
            j += k
        if span.stop is not None and j < len(new) and new[j] == span.stop:
            j += 1  # the template writes the stop token back (e.g. <|im_end|>)
        i = span.end
    return j


def _same_text(body: list[int], new: Sequence[int], j: int, decode: Callable[[Sequence[int]], str]) -> int | None:
    """The k for which ``new[j:j+k]`` decodes to the text of ``body`` (the same text, tokenised
    differently from how the model sampled it), or None."""
    text = decode(body)
    for k in range(1, min(len(new) - j, 4 * len(body) + 16) + 1):
        got = decode(new[j:j + k])
        if got == text:
            return k
        if len(got) > len(text) + 8:
            return None
    return None


class Transcript:
    """Contract: ``Transcript(limits, decode, text)`` records the calls of one episode
    that a client (an agent) makes through the OpenAI-compatible endpoint.
    - ``covered(rendered)`` then ``extend(rendered, covered)``: the call's request
      rendered by the chat template and tokenised (two steps, so a caller can
      refuse the call on a budget before anything is recorded). The first
      call's ids are the prompt (``loss_mask`` 0). A later call must continue
      the recorded sequence (prompt + every completion and suffix so far):
      ``match_prefix`` walks the recorded tokens against ``rendered``; the
      part past them, the new messages (tool results, user turns, the next
      generation prompt), is appended with ``loss_mask`` 0, logprob 0.0,
      version -1. The engine then continues the recorded ids
      themselves, so the history's tokens are the ones the model sampled.
    - Matching rules: tokens the policy did not produce must be equal; a
      completion may end with a stop token (EOS) that the template does not
      write back (then it is skipped there, as the template writes its own end
      of turn); a completion whose text the tokenizer splits differently now
      matches by its text (the sampled ids are kept).
    - A call that does not continue the record (the client rewrote, dropped or
      reordered earlier messages) is a rewrite: it is counted (``rewrites``)
      and starts a new segment whose prompt is the whole rendered request, so
      the client is still served; ``trajectory`` then refuses the episode
      (``EnvFailure("history_rewritten")``): an episode is trained only as one
      exact sequence, never silently on tokens the model did not see.
    - ``add(completion, ...)``: the policy's tokens (``loss_mask`` 1, the
      engine's logprobs and versions) and a ``TurnRecord``.
    - ``room()``: completion tokens the budgets (``limits.max_tokens`` and the
      context) still allow; ``calls`` counts the model calls.
    """
    def __init__(self, limits: EpisodeLimits, decode: Callable[[Sequence[int]], str],
                 text: Callable[[Sequence[int]], str]):
        # decode: ids -> text with special tokens (matching); text: what a reward reads (without them)
        self.limits, self.decode, self.text = limits, decode, text
        self._seg: _Segment | None = None
        self.rewrites = 0
        self.calls = 0

    @property
    def ids(self) -> list[int]:
        """What the engine continues: the current segment's prompt and completion so far."""
        return self._seg.recorded if self._seg is not None else []

    @property
    def prompt_len(self) -> int:
        return len(self._seg.prompt) if self._seg is not None else 0

    def covered(self, rendered: Sequence[int]) -> int | None:
        """How many tokens of ``rendered`` the record covers (0 before the first call), or None
        when ``rendered`` does not continue it (a rewrite)."""
        seg = self._seg
        return 0 if seg is None else match_prefix(seg.recorded, seg.spans, rendered, self.decode)

    def extend(self, rendered: Sequence[int], covered: int | None) -> bool:
        """Record a call's rendered request (``covered`` from ``covered()``); False when it rewrote
        the history, which starts a new segment."""
        rendered = list(rendered)
        seg = self._seg
        if seg is None or covered is None:
            if seg is not None:
                self.rewrites += 1
            self._seg = _Segment(rendered)
            return seg is None
        suffix = rendered[covered:]
        seg.ids += suffix
        seg.logprobs += [0.0] * len(suffix)
        seg.versions += [-1] * len(suffix)
        seg.mask += [0] * len(suffix)
        return True

    def room(self) -> int:
        """Completion tokens the episode's budgets still allow (the context and ``limits.max_tokens``)."""
        seg = self._seg
        if seg is None:
            return 0
        return min(self.limits.max_tokens, self.limits.context_limit - len(seg.prompt)) - len(seg.ids)

    def room_after(self, rendered: Sequence[int], covered: int | None) -> int:
        """``room()`` once ``extend(rendered, covered)`` has recorded the call's new tokens."""
        if self._seg is None or covered is None:
            return min(self.limits.max_tokens, self.limits.context_limit - len(rendered))
        return self.room() - (len(rendered) - covered)

    def add(self, c: Completion, stop_ids: set[int], tool_calls: tuple[str, ...] = (), env_s: float = 0.0,
            error: str = "") -> None:
        """The policy's turn: its tokens (cut to ``room()``), logprobs and versions, and its record."""
        seg = self._seg
        assert seg is not None, "add() before extend()"
        left = max(0, self.room())
        toks = list(c.token_ids[:left])
        start = len(seg.ids)
        at = len(seg.prompt) + start
        stop = toks[-1] if toks and len(toks) == len(c.token_ids) and c.finish_reason == "stop" \
            and toks[-1] in stop_ids else None
        seg.ids += toks
        seg.logprobs += list(c.logprobs[:left])
        seg.versions += list(c.versions[:left])
        seg.mask += [1] * len(toks)
        seg.spans.append(Span(at, at + len(toks), stop))
        seg.records.append(TurnRecord(start, len(seg.ids), 0.0, tuple(tool_calls), env_s, error))
        self.calls += 1

    def trajectory(self, task: Task, *, finish_reason: str, reward: float | None = None,
                   info: Mapping[str, float] | None = None, timings: Mapping[str, float] | None = None) -> Trajectory:
        """The episode as one trajectory; ``reward`` (the agent's) becomes its last turn's reward."""
        seg = self._seg
        if self.rewrites:
            raise EnvFailure("history_rewritten", f"task {task.id!r}: {self.rewrites} call(s) of the episode did not "
                                                  "continue its recorded tokens (the client rewrote, dropped or "
                                                  "reordered earlier messages); the episode is not trained")
        if seg is None or not seg.records:
            raise EnvFailure("bad_return", f"task {task.id!r}: the agent made no model call through the endpoint; "
                                           "call it with the base_url and api_key it was given")
        records = list(seg.records)
        if reward is not None:
            last = records[-1]
            records[-1] = TurnRecord(last.start, last.end, float(reward), last.tool_calls, last.env_s, last.error)
        traj = Trajectory(task=task, prompt_ids=tuple(seg.prompt), completion_ids=tuple(seg.ids),
                          logprobs=tuple(seg.logprobs), versions=tuple(seg.versions), loss_mask=tuple(seg.mask),
                          text=self.text(seg.ids), finish_reason=finish_reason, turns=len(records),
                          turn_records=tuple(records), timings=dict(timings or {}))
        # The agent's other numbers ride in reward_info until the reward service scores the trajectory.
        return traj.with_reward(0.0, info) if info else traj
