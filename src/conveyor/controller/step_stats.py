"""What a step of the RL loop reports besides the trainer's own metrics.

Contract: ``rollout_stats(groups, step)`` gives the batch's lengths, truncation,
staleness (versions behind the policy trained at ``step``) and the means of
the rewards' numeric ``reward_info`` keys (``reward_<key>``);
``sync_stats(new, published_at, pending, upto)`` the weight-sync times of
the versions up to ``upto`` from the engines' ``WeightSwap`` reports;
``engine_stats(clocks, last, rows)`` each engine's idle fraction since ``last``
(updated in place) and the engines' decode-step size and time, and the share of
decode time in steps of at most half an engine's share of the step's ``rows``
sequences. They read and return numbers only; the loop logs them.
"""
from __future__ import annotations

import math
import numbers
from collections import Counter

from conveyor.transport.messages import ROWS_KEY, EngineClock, WeightSwap
from conveyor.types import Group, Trajectory


def rollout_stats(groups: list[Group], step: int) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    lens = sorted(len(t.completion_ids) for t in trajs)
    stale = Counter(step - t.min_version for t in trajs)  # versions behind the policy being trained
    out = {"response_len": sum(lens) / len(lens), "response_len_max": float(lens[-1]),
           "response_len_p50": float(lens[len(lens) // 2]), "response_len_p99": float(lens[int(0.99 * (len(lens) - 1))]),
           "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
           "staleness_max": float(max(stale)), "staleness_mean": sum(k * v for k, v in stale.items()) / len(trajs),
           "multi_version_frac": sum(len(set(t.policy_versions)) > 1 for t in trajs) / len(trajs)}
    out.update({f"staleness_hist/{k}": v / len(trajs) for k, v in sorted(stale.items())})
    out.update(reward_info_means(trajs))
    return out


def reward_info_means(trajs: list[Trajectory]) -> dict[str, float]:
    """The mean of every numeric ``reward_info`` key (a reward's parts, a judge's counts) over the
    trajectories that carry it, as ``reward_<key>``."""
    sums: Counter = Counter()
    counts: Counter = Counter()
    for t in trajs:
        for k, v in t.reward_info.items():
            if isinstance(v, numbers.Real) and math.isfinite(v):
                sums[k] += float(v)
                counts[k] += 1
    return {f"reward_{k}": sums[k] / counts[k] for k in sorted(counts)}


def sync_stats(new: list[WeightSwap], published_at: dict[int, float], pending: list[WeightSwap],
               upto: int) -> dict[str, float]:
    """End of the optimizer step -> engine serving the version (ms, the slowest engine), the
    parts of it until the writer announced the version (negative when a streamed publish
    announced it before the optimizer ran) and until the engine's transport held it, and how
    long decoding paused for a swap; over the versions up to ``upto``. The loop passes the
    version published by the step before, which every engine serves by now (synchronous
    engines needed it for this step's rollouts), so each step reports one version whatever
    the race between its logging and the latest swap; later versions wait in ``pending``."""
    events = [e for e in pending + new if e.version <= upto]
    pending[:] = [e for e in pending + new if e.version > upto]
    ours = [e for e in events if e.version in published_at]
    out = {}
    if ours:
        out["weight_sync_ms"] = max((e.applied_at - published_at[e.version]) * 1e3 for e in ours)
    # when the writer began, and when the engine's transport held the version
    for key, stamps in (("weight_announce_ms", [(e.version, e.announced_at) for e in ours]),
                        ("weight_transfer_ms", [(e.version, e.received_at) for e in ours])):
        times = [(at - published_at[v]) * 1e3 for v, at in stamps if at is not None]
        if times:
            out[key] = max(times)
    if events:
        out["weight_pause_ms"] = max(e.pause_s for e in events) * 1e3
    return out


def engine_stats(clocks: dict[int, EngineClock], last: dict[int, EngineClock], rows: int = 0) -> dict[str, float]:
    """Each engine's idle fraction since the last call, and over all engines the mean rows of
    a decode step, its host-measured milliseconds, and the share of busy time spent in
    admissions (prefill) — what sets the engines' speed in a run. With ``rows`` (the step's
    sequences), ``engine_low_rows_frac``: the share of decode time in steps of at most half of
    an engine's share of them, rounded down to a power of two (the engines count time by rows
    in powers of two): a synchronous step's tail, or turns waiting on their environment.
    ``engine_device_wait_frac``: the share of busy time the engines' host waited for the device
    (near the device's share of a step when the device is the slower side; near 0 when the host's
    own work, or a CPU engine, sets the pace). ``last`` is updated in place."""
    out, totals = {}, Counter()
    for engine_id, now in clocks.items():
        before = last[engine_id]
        if now.busy_s < before.busy_s or now.idle_s < before.idle_s:  # a restarted engine counts anew
            before = EngineClock()
        busy, idle = now.busy_s - before.busy_s, now.idle_s - before.idle_s
        last[engine_id] = now
        if busy + idle > 0:
            out[f"engine{engine_id}_idle_frac"] = idle / (busy + idle)
        if now.counters:  # engines that keep no counters (HF runner, remote servers) add nothing
            totals["busy"] += busy
            totals.update({k: v - before.counters.get(k, 0) for k, v in now.counters.items()})
    if totals["decode_steps"] > 0:
        out["engine_batch_mean"] = totals["decode_rows"] / totals["decode_steps"]
        out["engine_step_ms"] = totals["decode_s"] / totals["decode_steps"] * 1e3
    counting = sum(1 for c in clocks.values() if c.counters)
    by_rows = {int(k[len(ROWS_KEY):]): v for k, v in totals.items() if k.startswith(ROWS_KEY)}
    if rows and counting and sum(by_rows.values()) > 0:
        half = 1 << max(0, (rows // (2 * counting)).bit_length() - 1)
        out["engine_low_rows_frac"] = sum(v for b, v in by_rows.items() if b <= half) / sum(by_rows.values())
    if totals["busy"] > 0:
        out["engine_prefill_frac"] = totals["prefill_s"] / totals["busy"]
        if "device_wait_s" in totals:
            out["engine_device_wait_frac"] = totals["device_wait_s"] / totals["busy"]
    return out
