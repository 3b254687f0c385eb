"""What a step of the RL loop reports besides the trainer's own metrics.

Contract: ``rollout_stats(groups, step)`` gives the batch's lengths, truncation
and staleness (versions behind the policy trained at ``step``);
``sync_stats(producer, published_at, pending, upto)`` the weight-sync times of
the versions up to ``upto`` from the engines' swap events; ``engine_stats(engines,
last)`` each engine's idle fraction since ``last`` (updated in place) and the
engines' decode-step size and time. They
read and return numbers only; the loop logs them.
"""
from __future__ import annotations

from collections import Counter

from conveyor.types import Group


def rollout_stats(groups: list[Group], step: int) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    lens = sorted(len(t.completion_ids) for t in trajs)
    stale = Counter(step - t.min_version for t in trajs)  # versions behind the policy being trained
    out = {"response_len": sum(lens) / len(lens), "response_len_max": float(lens[-1]),
           "response_len_p50": float(lens[len(lens) // 2]), "response_len_p99": float(lens[int(0.99 * (len(lens) - 1))]),
           "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
           "staleness_max": float(max(stale)), "staleness_mean": sum(k * v for k, v in stale.items()) / len(trajs),
           "multi_version_frac": sum(len(set(t.versions)) > 1 for t in trajs) / len(trajs)}
    out.update({f"staleness_hist/{k}": v / len(trajs) for k, v in sorted(stale.items())})
    return out


def sync_stats(producer, published_at: dict[int, float], pending: list, upto: int) -> dict[str, float]:
    """End of the optimizer step -> engine serving the version (ms, the slowest engine), the
    parts of it until the writer announced the version (negative when a streamed publish
    announced it before the optimizer ran) and until the engine's transport held it, and how
    long decoding paused for a swap; over the versions up to ``upto``. The loop passes the
    version published by the step before, which every engine serves by now (synchronous
    engines needed it for this step's rollouts), so each step reports one version whatever
    the race between its logging and the latest swap; later versions wait in ``pending``."""
    new, producer.stats.weight_events = producer.stats.weight_events, []
    events = [e for e in pending + new if e[1] <= upto]
    pending[:] = [e for e in pending + new if e[1] > upto]
    ours = [e for e in events if e[1] in published_at]
    out = {}
    if ours:
        out["weight_sync_ms"] = max((e[2] - published_at[e[1]]) * 1e3 for e in ours)
    for key, i in (("weight_announce_ms", 5), ("weight_transfer_ms", 4)):  # the writer began; the engine held it
        times = [(e[i] - published_at[e[1]]) * 1e3 for e in ours if e[i] is not None]
        if times:
            out[key] = max(times)
    if events:
        out["weight_pause_ms"] = max(e[3] for e in events) * 1e3
    return out


def engine_stats(engines, last: dict) -> dict[str, float]:
    """Each engine's idle fraction since the last call, and over all engines the mean rows of
    a decode step, its host-measured milliseconds, and the share of busy time spent in
    admissions (prefill) — what sets the engines' speed in a run. ``last`` is updated in place."""
    out, totals = {}, Counter()
    for e in engines:
        b0, i0, c0 = last[e.engine_id]
        busy, idle = e.busy_s - b0, e.idle_s - i0
        counters = dict(e.counters)
        last[e.engine_id] = (e.busy_s, e.idle_s, counters)
        if busy + idle > 0:
            out[f"engine{e.engine_id}_idle_frac"] = idle / (busy + idle)
        if counters:  # engines that keep no counters (HF runner, remote servers) add nothing
            totals["busy"] += busy
            totals.update({k: v - c0.get(k, 0) for k, v in counters.items()})
    if totals["decode_steps"] > 0:
        out["engine_batch_mean"] = totals["decode_rows"] / totals["decode_steps"]
        out["engine_step_ms"] = totals["decode_s"] / totals["decode_steps"] * 1e3
    if totals["busy"] > 0:
        out["engine_prefill_frac"] = totals["prefill_s"] / totals["busy"]
    return out
