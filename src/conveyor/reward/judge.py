"""A generative judge as a reward: a frozen language model reads each completion and writes a
critique ending in a score, which becomes the reward (an ``api.BatchReward``).

- ``JudgeReward(engine, tokenizer, cfg, ...)`` judges with any ``runtime.handles.Generator``;
  ``score_batch(trajs)`` sends every judge prompt of the batch in one ``generate`` call and
  returns one dict per trajectory, in order.
- Pointwise (one prompt per trajectory) or pairwise (each ordered pair of a group, judged in
  both orders); a trajectory none of whose judgements parse gets the fallback, counted.
- One ``generate`` runs at a time; a call waits at most ``wait_s`` for the engine, then raises
  ``TimeoutError``.

It knows nothing of threads that call it, deadlines of the service, or how its engine was built
(``run/judge_setup.py`` builds it from the config).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.reward.judge_text import (
    DEFAULT_TEMPLATES,
    NO_ANSWER,
    ScoreParser,
    aggregate,
    fit_fields,
    hash_score,
    template_problem,
)
from conveyor.runtime.handles import Generator
from conveyor.types import SamplingParams, Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config import JudgeConfig

COUNTERS = ("calls", "items", "prompts", "samples", "unparseable", "out_of_range", "fallbacks", "too_long",
            "no_pair", "tokens")


@dataclass
class _Prompt:
    """One judge prompt: whose verdict it gives (``sides``: item index, +1 when the item is A or
    scored alone, -1 when it is B) and its token ids (None: it could not fit)."""
    sides: list[tuple[int, int]]
    ids: list[int] | None


@dataclass
class _Item:
    verdicts: list[float] = field(default_factory=list)
    judgements: int = 0
    parsed: int = 0
    tokens: int = 0
    too_long: bool = False
    no_pair: bool = False


class JudgeReward:
    """A frozen language model's judgement of each completion as its reward.

    Contract
    - ``JudgeReward(engine, tokenizer, cfg, max_batch, fallback_value, seed, wait_s)`` judges with any
      ``runtime.handles.Generator``, such as every ``rollout.api.RolloutEngine`` (the native engine on
      a device of its own, vLLM, a remote server), and the judge's tokenizer; ``cfg`` is the run's ``reward.judge`` section
      (``config.JudgeConfig``). ``score_batch(trajs)`` renders every judge prompt of the batch
      (template fields cut in the middle to fit the judge's context; ``{prompt}`` is the task
      before the policy's templates, ``task.info["raw_prompt"]``, where the data layer kept it),
      sends them ALL to the engine in one ``generate`` call with ``n = cfg.samples``, reads the
      last score of each judgement (``judge_text.ScoreParser``: the declared range mapped onto
      [0, 1]) and returns one dict per trajectory, in order.
    - Pointwise: one judge prompt per trajectory; its reward is the ``cfg.aggregate`` of its
      parsed samples (``mean``, or ``vote``: the majority score).
    - Pairwise: trajectories of the SAME CALL with the same task and prompt form a group; each
      ordered pair (a, b) of it is one prompt whose score s says how much better A is (the range's
      middle: equal), so P(A better) = normalised s. A pair is judged in both orders, which cancels
      a judge's preference for a position. A trajectory's reward is its mean win probability over
      its comparisons (``vote``: each comparison's majority winner counts 1, a tie 0.5): a group of
      m costs m(m-1) prompts x samples, against m x samples pointwise. A trajectory alone in its
      call (evaluation's one sample per task, or a group the reward service split over two calls)
      is compared with its task's reference answer in both orders; without one it gets the
      fallback (``reward_error`` "no pair").
    - A trajectory none of whose judgements parse gets the fallback: ``reward.fallback``, or with
      ``cfg.fallback = "hash"`` a seeded hash of its completion text in [0, 1); its ``reward_error``
      says why ("unparseable", "too long" when its prompt cannot fit the judge's context even cut).
      Every such case and every unparseable sample is counted (``stats()``).
    - ``reward_info`` of each trajectory: ``judge_parsed`` (share of its judgements that parsed),
      ``judge_fallback`` (1 when it got the fallback), ``judge_tokens`` (mean tokens per judgement)
      and ``judge_tokens_per_s`` (the call's generation rate), numbers only.
    - One ``generate`` runs at a time (engines are not reentrant): a call waits at most ``wait_s``
      for the engine and then raises ``TimeoutError``; the reward service turns that into the
      fallback for the batch. It runs with the engine's GPU (``engine.cuda_device``) as the calling
      thread's current CUDA device, so a judge on a GPU of its own computes there whichever thread
      calls it. ``close()`` closes the engine.
    """
    name = "judge"

    def __init__(self, engine: Generator, tokenizer: Any, cfg: JudgeConfig, *, max_batch: int = 64,
                 fallback_value: float = 0.0, seed: int = 0, wait_s: float = 600.0) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.template = cfg.template or DEFAULT_TEMPLATES[cfg.mode]
        problem = template_problem(self.template, cfg.mode)
        if problem:
            raise ValueError(f"reward.judge.template {problem}")
        self.parser = ScoreParser(cfg.score_pattern, cfg.score_min, cfg.score_max)
        self.max_batch, self.fallback, self.seed, self.wait_s = int(max_batch), float(fallback_value), int(seed), wait_s
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                     max_new_tokens=cfg.max_new_tokens, n=cfg.samples)
        limit = engine.context_limit
        self.budget = None if limit is None else limit - cfg.max_new_tokens
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"reward.judge.max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the "
                             f"judge's context of {limit} tokens; lower it")
        self._engine_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the counters and the tokenizer
        self._counts = {k: 0 for k in COUNTERS}
        self._generate_s = 0.0

    # ---- the BatchReward protocol -----------------------------------------------------------

    def score_batch(self, trajs: Sequence[Trajectory]) -> list[dict]:
        trajs = list(trajs)
        items = [_Item() for _ in trajs]
        with self._lock:
            prompts = self._pointwise(trajs) if self.cfg.mode == "pointwise" else self._pairwise(trajs, items)
        for p in prompts:
            if p.ids is None:
                for i, _ in p.sides:
                    items[i].too_long = True
        runnable = [p for p in prompts if p.ids is not None]
        texts, tokens, seconds = self._generate([p.ids for p in runnable])
        unparseable = out_of_range = 0
        for p, samples, toks in zip(runnable, texts, tokens):
            read = [self.parser.parse(t) for t in samples]
            values = [r.value for r in read if r.value is not None]
            unparseable += len(read) - len(values)
            out_of_range += sum(r.reason == "out of range" for r in read)
            for i, side in p.sides:
                items[i].judgements += len(read)
                items[i].parsed += len(values)
                items[i].tokens += sum(toks)
                if values:
                    items[i].verdicts.append(self._verdict(values, side))
        rate = sum(map(sum, tokens)) / seconds if seconds > 0 else 0.0
        out = [self._result(t, it, rate) for t, it in zip(trajs, items)]
        with self._lock:
            c = self._counts
            c["calls"] += 1
            c["items"] += len(trajs)
            c["prompts"] += len(runnable)
            c["samples"] += sum(len(s) for s in texts)
            c["unparseable"] += unparseable
            c["out_of_range"] += out_of_range
            c["fallbacks"] += sum(o["judge_fallback"] == 1.0 for o in out)
            c["too_long"] += sum(p.ids is None for p in prompts)
            c["no_pair"] += sum(it.no_pair for it in items)
            c["tokens"] += sum(map(sum, tokens))
            self._generate_s += seconds
        return out

    def stats(self) -> dict[str, float]:
        """Running totals since the judge was built: calls, items judged, prompts and samples
        generated, unparseable samples (out-of-range ones among them), items that got the
        fallback, prompts too long to fit, lone pairwise items without a reference, tokens
        written, seconds in ``generate`` and tokens per second of generation."""
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            out["generate_s"] = self._generate_s
            out["tokens_per_s"] = self._counts["tokens"] / self._generate_s if self._generate_s > 0 else 0.0
        return out

    def close(self) -> None:
        self.engine.close()

    # ---- prompts ------------------------------------------------------------------------------

    def _pointwise(self, trajs: list[Trajectory]) -> list[_Prompt]:
        return [_Prompt([(i, 1)], self._ids({"prompt": _question(t), "completion": t.text,
                                              "answer": t.task.answer or NO_ANSWER}, ("completion", "prompt")))
                for i, t in enumerate(trajs)]

    def _pairwise(self, trajs: list[Trajectory], items: list[_Item]) -> list[_Prompt]:
        groups: dict[tuple, list[int]] = {}
        for i, t in enumerate(trajs):
            groups.setdefault((t.task.id, t.prompt_ids), []).append(i)
        out = []
        for members in groups.values():
            task = trajs[members[0]].task
            base = {"prompt": _question(trajs[members[0]]), "answer": task.answer or NO_ANSWER}
            if len(members) > 1:
                pairs = [(a, b) for a in members for b in members if a != b]
                out += [self._pair(base, trajs[a].text, trajs[b].text, [(a, 1), (b, -1)]) for a, b in pairs]
            elif task.answer:  # alone in this call: against the reference answer, both orders
                (i,) = members
                out += [self._pair(base, trajs[i].text, task.answer, [(i, 1)]),
                        self._pair(base, task.answer, trajs[i].text, [(i, -1)])]
            else:
                items[members[0]].no_pair = True
        return out

    def _pair(self, base: dict, a: str, b: str, sides: list[tuple[int, int]]) -> _Prompt:
        fields = {**base, "completion_a": a, "completion_b": b}
        return _Prompt(sides, self._ids(fields, ("completion_a", "completion_b", "prompt")))

    def _ids(self, fields: dict[str, str], shrinkable: tuple[str, ...]) -> list[int] | None:
        tok = self.tokenizer

        def render(values) -> list[int]:
            text = self.template.format(**{k: values[k] for k in fields})
            if self.cfg.chat_template:
                text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
                return tok.encode(text, add_special_tokens=False)
            return tok.encode(text)

        if self.budget is None:
            ids = render(fields)
        else:
            ids = fit_fields(render, fields, shrinkable, self.budget,
                             lambda s: tok.encode(s, add_special_tokens=False), tok.decode)
        return ids or None  # an empty prompt cannot be judged either

    # ---- generation and verdicts ------------------------------------------------------------

    def _generate(self, prompts: list[list[int]]) -> tuple[list[list[str]], list[list[int]], float]:
        """Every prompt's samples as texts and token counts, and the seconds ``generate`` took."""
        if not prompts:
            return [], [], 0.0
        # The call's seed follows from what it judges, so the same batch is judged the same way
        # whichever worker thread runs it, and when.
        h = hashlib.blake2b(str(self.seed).encode(), digest_size=8)
        for ids in prompts:
            h.update(len(ids).to_bytes(4, "little") + b"".join(i.to_bytes(4, "little") for i in ids))
        params = dataclasses.replace(self.params, seed=int.from_bytes(h.digest(), "little") >> 2)
        if not self._engine_lock.acquire(timeout=self.wait_s):
            raise TimeoutError(f"judge engine still busy with another batch after {self.wait_s:g}s")
        try:
            t0 = time.perf_counter()
            with _on_device(self.engine.cuda_device):
                outs = self.engine.generate(prompts, params)
            seconds = time.perf_counter() - t0
        finally:
            self._engine_lock.release()
        return ([[c.text for c in cs] for cs in outs], [[len(c.token_ids) for c in cs] for cs in outs], seconds)

    def _verdict(self, values: list[float], side: int) -> float:
        """One prompt's samples as the item's verdict: its score (pointwise), or its win
        probability (pairwise; ``vote`` counts each sample's winner, the middle a tie)."""
        if self.cfg.mode == "pairwise" and self.cfg.aggregate == "vote":
            values = [1.0 if v > 0.5 else 0.0 if v < 0.5 else 0.5 for v in values]
        v = aggregate(values, self.cfg.aggregate)
        return v if side > 0 else 1.0 - v

    def _result(self, traj: Trajectory, item: _Item, rate: float) -> dict:
        info = {"judge_parsed": item.parsed / item.judgements if item.judgements else 0.0,
                "judge_tokens": item.tokens / item.judgements if item.judgements else 0.0,
                "judge_tokens_per_s": rate}
        if item.verdicts:
            return {"reward": sum(item.verdicts) / len(item.verdicts), "judge_fallback": 0.0, **info}
        why = ("no pair" if item.no_pair else "too long" if item.too_long and not item.judgements
               else "unparseable")
        reward = hash_score(traj.text, self.seed) if self.cfg.fallback == "hash" else self.fallback
        return {"reward": reward, "judge_fallback": 1.0, "reward_error": why, **info}



def _question(traj: Trajectory) -> str:
    """The task as a judge should read it: before the policy's templates and chat markup when the
    data layer kept it (``raw_prompt``), else the prompt as the policy saw it."""
    raw = (traj.task.info or {}).get("raw_prompt")
    return raw if isinstance(raw, str) and raw else traj.task.prompt


def _on_device(device: Any) -> contextlib.AbstractContextManager:
    """``device`` as the current CUDA device (streams, graphs and memory queries default to it)."""
    if device is None:
        return contextlib.nullcontext()
    import torch
    return torch.cuda.device(device)
