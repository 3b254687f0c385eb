"""Single-turn rollout workflow: tasks in, groups of trajectories out.

Contract: ``rollout_groups(engine, tokenizer, tasks, params, ...)`` tokenizes
each task's prompt once (``prepare_prompts``), asks the engine for
``params.n`` completions per prompt in one batched call, and returns one
``Group`` per task with unscored trajectories (reward 0) (``to_groups``). The
two halves are separate so that a producer can send the prompts to an engine
in another thread or process. Prompts that do not fit the context are
skipped and counted in ``stats["prompt_too_long"]`` rather than crashing a
run. It knows nothing of rewards, advantages or training.
"""
from __future__ import annotations

import time

from conveyor.types import Group, Task, Trajectory


def tokenize_prompt(tokenizer, prompt: str, add_special_tokens: bool) -> tuple[int, ...]:
    return tuple(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


def prepare_prompts(tokenizer, tasks: list[Task], max_prompt_tokens: int, add_special_tokens: bool = False,
                    stats: dict | None = None) -> tuple[list[Task], list[tuple[int, ...]]]:
    """Tokenize once; drop (and count) prompts that are empty or do not fit the context."""
    stats = stats if stats is not None else {}
    prompts, kept = [], []
    for task in tasks:
        ids = tokenize_prompt(tokenizer, task.prompt, add_special_tokens)
        if not ids or len(ids) > max_prompt_tokens:
            key = "prompt_too_long" if ids else "prompt_empty"
            stats[key] = stats.get(key, 0) + 1
            continue
        prompts.append(ids)
        kept.append(task)
    return kept, prompts


def to_groups(tokenizer, tasks: list[Task], prompts: list[tuple[int, ...]], outs, elapsed: float) -> list[Group]:
    """Engine completions (one list of n per prompt) -> one unscored Group per task."""
    groups = []
    for task, prompt, comps in zip(tasks, prompts, outs):
        trajs = tuple(
            Trajectory(
                task=task, prompt_ids=prompt, completion_ids=tuple(c.token_ids),
                logprobs=tuple(c.logprobs), versions=tuple(c.versions),
                loss_mask=(1,) * len(c.token_ids),
                text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                finish_reason=c.finish_reason, timings={"generate_batch_s": elapsed},
                routed_experts=c.routed_experts,
            )
            for c in comps
        )
        groups.append(Group(task, trajs))
    return groups


def rollout_groups(engine, tokenizer, tasks: list[Task], params, max_prompt_tokens: int,
                   add_special_tokens: bool = False, stats: dict | None = None) -> list[Group]:
    kept, prompts = prepare_prompts(tokenizer, tasks, max_prompt_tokens, add_special_tokens, stats)
    if not prompts:
        return []
    t0 = time.perf_counter()
    outs = engine.generate([list(p) for p in prompts], params)
    return to_groups(tokenizer, kept, prompts, outs, time.perf_counter() - t0)
