"""The protocol's metrics, computed the same way for every system.

Inputs (both written by every peer in the same format)
- ``steps``: the ``kind == "train"`` records of a run's ``metrics.jsonl``,
  one per rollout batch (a conveyor loop step): ``time/step`` (the whole
  step), ``time/prepare`` (batch building and any extra trainer forward),
  ``time/train`` (forward, backward, optimizer), engine busy time as
  ``time/generate`` or as ``engine<i>_idle_frac`` (see ``step_view``),
  optionally ``weight_sync_ms`` (and its parts), ``engine_step_ms`` (and the
  engines' other step stats), ``clip_frac`` and ``staleness_hist/<k>``.
- ``trajs``: the ``split == "train"`` lines of ``trajectories.jsonl``
  (``rewards.py``), in scoring order; step k owns lines
  ``[k * samples_per_step, (k + 1) * samples_per_step)``.

Definitions (steady window = all steps but the first ``warmup`` (2); when a
run has no more than that, the window is every step and ``steady`` is False)
- trained samples/s = samples in the window / sum of its ``time/step``.
- rollout tokens/s = completion tokens / engine busy seconds (summed over
  engines, so it is per rollout device); MBU = that / the decode bound.
- training tokens/s = prompt + completion tokens (every position goes
  through forward and backward) / sum of ``time/train``; MFU = that x 6N
  (8N with recompute) / peak FLOP/s of all trainer GPUs (the caller passes
  one GPU's peak x the trainer ranks).
- engine idle = 1 - engine busy / (engines x step), the busy time scaled up
  by 1 / ``engine_report_coverage`` when some steps carry no engine report;
  trainer idle = 1 - (prepare + train) / step (reward scoring, weight sync
  and loop overhead count as idle for both).
- staleness of a trajectory = (version trained) - (its oldest token
  version); histogram (see ``staleness``) and the fraction spanning more
  than one version.
- ``curve``: per step (samples so far, seconds since RL start, mean train
  reward); ``time_to_threshold_s``: the first time the mean reward over the
  last ``window`` steps reaches the threshold.

Pure Python and no torch: it does not know which system produced the files.
"""
from __future__ import annotations

import statistics
from collections import Counter

from benchmarks.lengths import length_stats

WARMUP_STEPS = 2
# Weight sync, per step in the loop's metrics: end of step -> engine serving the version, its
# parts until the writer announced it and until the engine held it, the trainer's publish
# call, and the decode pause for the swap (medians over the steady window here).
# The engines' decode steps (mean rows, host-measured ms), their share of busy time in prefill, and
# the share of decode time in steps of at most half an engine's sequences of a step.
MEDIAN_KEYS = ("weight_sync_ms", "weight_announce_ms", "weight_transfer_ms", "weight_publish_ms", "weight_pause_ms",
               "engine_batch_mean", "engine_step_ms", "engine_prefill_frac", "engine_low_rows_frac",
               "engine_device_wait_frac")


def step_view(rec: dict) -> dict:
    """One step record in the terms every formula below uses, whichever system logged it.

    Engine busy seconds: ``time/generate`` where the loop generates in line (TRL, a synchronous
    loop that times generation), else ``(1 - engine<i>_idle_frac) x time/step`` per engine (a loop
    whose engines run beside the trainer and report their own idle fraction).
    """
    step_s = float(rec.get("time/step") or 0.0)
    if rec.get("time/generate") is not None:
        busy = [float(rec["time/generate"])]
    else:
        busy = [(1.0 - float(rec[k])) * step_s for k in sorted(rec)
                if k.startswith("engine") and k.endswith("_idle_frac") and rec[k] is not None]
    hist = {k.split("/", 1)[1]: float(v) for k, v in rec.items() if k.startswith("staleness_hist/")}
    return {"step_s": step_s, "engine_busy_s": busy, "train_s": float(rec.get("time/train") or 0.0),
            "trainer_busy_s": float(rec.get("time/prepare") or 0.0) + float(rec.get("time/train") or 0.0),
            "staleness_hist": hist, **{k: rec.get(k) for k in MEDIAN_KEYS},
            "num_seqs": float(rec.get("num_seqs") or 0.0), "clip_frac": rec.get("clip_frac")}


def per_step_trajs(trajs: list[dict], samples_per_step: int, num_steps: int) -> list[list[dict]]:
    chunks = [trajs[i * samples_per_step:(i + 1) * samples_per_step] for i in range(num_steps)]
    return [c for c in chunks if len(c) == samples_per_step]


def staleness(steps: list[dict], chunks: list[list[dict]]) -> dict:
    """Histogram of (trained version - oldest token version), as counts of trajectories.

    Taken from the steps' own ``staleness_hist/<k>`` fractions when the system logs them (they
    are exact however scoring order and training order differ), else from the recorded
    trajectories cut into steps by count (exact for a synchronous system).
    """
    hist: Counter = Counter()
    views = [step_view(s) for s in steps]
    if views and all(v["staleness_hist"] for v in views):
        for v in views:
            for k, frac in v["staleness_hist"].items():
                hist[int(k)] += round(frac * v["num_seqs"])
    else:
        for k, chunk in enumerate(chunks):
            for t in chunk:
                hist[k - int(t["version"])] += 1
    multi = [int(t.get("versions", 1)) > 1 for c in chunks for t in c]
    return {"histogram": {str(k): v for k, v in sorted(hist.items())},
            "multi_version_frac": sum(multi) / len(multi) if multi else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def throughput(steps: list[dict], chunks: list[list[dict]], samples_per_step: int, warmup: int = WARMUP_STEPS,
               n_params: int | None = None, peak_flops: float | None = None, recompute: bool = False,
               decode_bound: float | None = None) -> dict:
    n = min(len(steps), len(chunks)) if chunks else len(steps)
    steady = n > warmup
    lo = warmup if steady else 0
    win = [step_view(s) for s in steps[lo:n]]
    win_chunks = chunks[lo:n]
    step_s = sum(v["step_s"] for v in win)
    engines = max((len(v["engine_busy_s"]) for v in win), default=0)
    # A loop whose engines report idle fractions only when a generation finishes leaves some
    # steps without one; those steps are covered by scaling the reporting steps' busy time.
    covered = sum(v["step_s"] for v in win if len(v["engine_busy_s"]) == engines and engines)
    gen_s = sum(sum(v["engine_busy_s"]) for v in win)
    if 0 < covered < step_s:
        gen_s *= step_s / covered
    train_s = sum(v["train_s"] for v in win)
    comp_tok = sum(t["completion_len"] for c in win_chunks for t in c)
    all_tok = comp_tok + sum(t["prompt_len"] for c in win_chunks for t in c)
    rollout_tps = comp_tok / gen_s if gen_s > 0 and win_chunks else None  # per busy engine
    train_tps = all_tok / train_s if train_s > 0 and win_chunks else None
    flops = (8 if recompute else 6) * n_params if n_params else None
    weights = {k: [v[k] for v in win if v.get(k) is not None] for k in MEDIAN_KEYS}
    clip = [v["clip_frac"] for v in win if v["clip_frac"] is not None]
    return {
        "steps": len(steps), "steady": steady, "window": [lo + 1, n] if n else None,
        "trained_samples_per_s": samples_per_step * len(win) / step_s if step_s > 0 else None,
        "median_step_s": statistics.median(v["step_s"] for v in win) if win else None,
        "rollout_tokens_per_s": rollout_tps, "mbu": _ratio(rollout_tps, decode_bound), "engines": engines,
        "training_tokens_per_s": train_tps,
        "mfu": _ratio(train_tps * flops if train_tps and flops else None, peak_flops),
        "engine_idle_frac": 1.0 - gen_s / (engines * step_s) if step_s > 0 and engines else None,
        "trainer_idle_frac": 1.0 - sum(v["trainer_busy_s"] for v in win) / step_s if step_s > 0 else None,
        "engine_report_coverage": covered / step_s if step_s > 0 else None,
        "seconds": {"step": step_s, "engine_busy": gen_s, "train": train_s,
                    "trainer_busy": sum(v["trainer_busy_s"] for v in win)},
        **{k: statistics.median(xs) if xs else None for k, xs in weights.items()},
        "clip_frac": statistics.mean(clip) if clip else None,
    }


def learning_curve(steps: list[dict], chunks: list[list[dict]], samples_per_step: int,
                   rl_start_unix: float | None) -> list[list[float]]:
    """[samples so far, seconds since RL start, mean train reward] per step."""
    out, t_cum = [], 0.0
    for k, (s, c) in enumerate(zip(steps, chunks)):
        t_cum += float(s.get("time/step") or 0.0)
        t = float(s["time"]) - rl_start_unix if rl_start_unix and s.get("time") else t_cum
        out.append([samples_per_step * (k + 1), round(t, 3), sum(x["reward"] for x in c) / len(c)])
    return out


def time_to_threshold(curve: list[list[float]], threshold: float | None, window: int = 5) -> float | None:
    if threshold is None:
        return None
    for i in range(len(curve)):
        recent = curve[max(0, i - window + 1):i + 1]
        if len(recent) == window and sum(r[2] for r in recent) / window >= threshold:
            return curve[i][1]
    return None


def summarize(steps: list[dict], trajs: list[dict], samples_per_step: int, cap: int | None = None,
              warmup: int = WARMUP_STEPS, rl_start_unix: float | None = None, threshold: float | None = None,
              **bound_kw) -> dict:
    """Everything a JSON row needs from one run's two files."""
    train = [t for t in trajs if t.get("split", "train") == "train"]
    chunks = per_step_trajs(train, samples_per_step, len(steps))
    curve = learning_curve(steps, chunks, samples_per_step, rl_start_unix)
    return {
        **throughput(steps, chunks, samples_per_step, warmup, **bound_kw),
        "lengths": length_stats([t["completion_len"] for c in chunks for t in c], cap),
        "staleness": staleness(steps, chunks),
        "curve": curve,
        "time_to_threshold_s": time_to_threshold(curve, threshold),
        "samples_trained": samples_per_step * len(steps),
        "trajectories_recorded": len(train),
    }


def mean_decode_context(trajs: list[dict]) -> float | None:
    """Token-weighted mean context length while decoding: sum(P*l + l(l+1)/2) / sum(l)."""
    num = sum(t["prompt_len"] * t["completion_len"] + t["completion_len"] * (t["completion_len"] + 1) / 2
              for t in trajs)
    den = sum(t["completion_len"] for t in trajs)
    return num / den if den else None
