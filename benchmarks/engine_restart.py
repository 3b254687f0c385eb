"""How long training stalls when an engine process dies: kill -9 of engine 0 mid-run, then the
time from the kill to the next trained steps, on the tiny model with the local launcher.

Each trial starts ``conveyor train`` (streaming, staleness 1, disaggregated), waits for step
``--kill-at``, kills the engine process and reads ``metrics.jsonl``: ``resume_s`` is the time
from the kill to the first step trained after the replacement served (the largest gap between
two trained steps after the kill, less the median gap before it, is ``stall_s``). With
``--while-starting`` the engine is killed before it reports ready instead (the run must restart
it and complete; the time is from the kill to the first trained step).

    python benchmarks/engine_restart.py --trials 3 [--override launch.weight_sync=broadcast ...]

Prints one JSON line per trial and the medians, and appends the medians to
benchmarks/results/engine_restart_cpu.jsonl. CPU only; the numbers depend on the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness import append_record  # noqa: E402
RUN = ["sft.steps=0", "data.eval_size=8", "observe.tensorboard=false", "observe.progress=false",
       "launch.placement=disaggregated", "launch.timeout_s=120", "loop.max_staleness=1", "loop.eval_every=0"]
# The smallest model and steps (tests/e2e/test_faults.py's); --recipe-model keeps the default recipe's.
TINY = ["loop.batch_size=4", "rollout.n=4", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
        "model.tiny.intermediate_size=64"]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if r.get("kind") == "train":
            out.append(r)
    return out


def _pids(run_dir: Path, role: str) -> list[int]:
    log = run_dir / "logs" / f"{role}.log"
    text = log.read_text() if log.exists() else ""
    return [int(p) for p in re.findall(rf"\[{role}\] started pid=(\d+)", text)]


def _wait(cond, proc: subprocess.Popen, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before {what}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.02)
    raise SystemExit(f"{what}: not within {timeout}s")


def trial(steps: int, kill_at: int, while_starting: bool, overrides: list[str]) -> dict:
    """One run with engine 0 killed; the times as in the module docstring."""
    run_dir = Path(tempfile.mkdtemp(prefix="engine-restart-")) / "run"
    cmd = [sys.executable, "-m", "conveyor.cli", "train", f"--output-dir={run_dir}", f"loop.steps={steps}",
           *RUN, *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        if while_starting:  # killed as soon as its process runs, long before it is ready
            pid = _wait(lambda: (_pids(run_dir, "engine0") or [None])[0], proc, 240, "engine0 started")
        else:
            _wait(lambda: any(r["step"] >= kill_at for r in _rows(run_dir)), proc, 240, f"step {kill_at}")
            pid = _pids(run_dir, "engine0")[-1]
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {err[-3000:]}")
    rows = _rows(run_dir)
    times = [r["time"] for r in rows]
    after = [t for t in times if t > killed]
    before = [b - a for a, b in zip(times, times[1:]) if b <= killed]
    gaps = [b - a for a, b in zip([killed] + after, after)]
    out = {"while_starting": while_starting, "steps": len(rows), "restarts": rows[-1].get("engine_restarts"),
           "first_step_after_kill_s": round(after[0] - killed, 2) if after else None,
           "stall_s": round(max(gaps[:10]) - (statistics.median(before) if before else 0.0), 2) if gaps else None,
           "median_step_s": round(statistics.median(before), 3) if before else None}
    if not while_starting:  # the step whose groups the replacement generated: the longest gap's end
        out["resume_s"] = round(after[gaps.index(max(gaps[:10]))] - killed, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=4)
    ap.add_argument("--while-starting", action="store_true")
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--recipe-model", action="store_true", help="the default recipe's model and batch")
    a = ap.parse_args()
    overrides = ([] if a.recipe_model else TINY) + a.override
    results = []
    for _ in range(a.trials):
        r = trial(a.steps, a.kill_at, a.while_starting, overrides)
        print(json.dumps(r), flush=True)
        results.append(r)
    key = "first_step_after_kill_s" if a.while_starting else "resume_s"
    summary = {"median_" + key: statistics.median(r[key] for r in results),
               "median_stall_s": statistics.median(r["stall_s"] for r in results), "trials": len(results),
               "load_1min": round(os.getloadavg()[0], 2)}
    print(json.dumps(summary))
    append_record("engine_restart", summary, gpu=False,
                  config={"while_starting": a.while_starting, "recipe_model": a.recipe_model, "steps": a.steps,
                          "kill_at": a.kill_at, "overrides": a.override})


if __name__ == "__main__":
    main()
