"""Reward throughput of the two executors on a CPU-bound verifier: trajectories/s, threads vs processes.

The verifier (``spin``: pure-Python arithmetic, so it holds the GIL the whole
call) is calibrated here to about ``--call-ms`` of CPU time per call. ``reward.executor:
thread`` runs it on ``--workers`` threads of one interpreter, which take turns
holding the GIL; ``reward.executor: process`` on as many worker processes, each
with its own. Both score the same ``--trajectories`` trajectories, after one
warm-up call per worker; the process pool's start (spawning and loading the
reward) is measured apart. The serial rate (one call after another in this
process) is the yardstick: the ideal is ``workers`` times it, bounded by the
free cores. Beside each rate, the CPU cores it used on average (CPU seconds
of this process and its workers / wall seconds): threads cannot pass one
core (the GIL); processes can use ``workers`` cores where the machine gives
them that much. Linux (reads /proc). Appends one record to
benchmarks/results/ (workload ``reward_pool``).

    nice -n 5 python benchmarks/reward_pool.py [--trajectories 120] [--call-ms 50] [--workers 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

from benchmarks.harness import append_record  # noqa: E402
from conveyor.reward.api import load_reward  # noqa: E402
from conveyor.reward.factory import RewardSpec  # noqa: E402
from conveyor.reward.processes import ProcessRewardService  # noqa: E402
from conveyor.reward.service import RewardService  # noqa: E402
from conveyor.types import Task, Trajectory  # noqa: E402

SPEC = "benchmarks.reward_pool:spin"


def spin(traj: Trajectory, iterations: int = 100_000) -> float:
    """``iterations`` rounds of a linear congruence in pure Python: CPU work that holds the GIL."""
    x = len(traj.text) + 1
    for _ in range(iterations):
        x = (x * 1103515245 + 12345) % 2147483648
    return x / 2147483648


def trajectories(n: int) -> list[Trajectory]:
    return [Trajectory(Task(f"t{i}", "q", "a"), (1,), (5,), (-0.5,), (0,), (1,), text="x" * (i % 7))
            for i in range(n)]


def calibrate(call_ms: float) -> tuple[int, float]:
    """Iterations of ``spin`` for about ``call_ms`` of CPU time per call (CPU, not wall time: on a
    shared machine the wall time of a call also holds the waits for a core), and the median ms."""
    traj = trajectories(1)[0]
    n = 20_000
    for _ in range(8):  # a shared CPU may never settle within 5 %: the last estimate then stands
        times = []
        for _ in range(5):
            t0 = time.thread_time()
            spin(traj, n)
            times.append((time.thread_time() - t0) * 1e3)
        ms = statistics.median(times)
        if abs(ms - call_ms) / call_ms < 0.05:
            break
        n = max(1, round(n * call_ms / ms))
    return n, ms


def cpu_s() -> float:
    """CPU seconds used so far by this process (all its threads) and its live child processes."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rate(service, trajs: list[Trajectory]) -> tuple[float, float]:
    """Trajectories/s, and the CPU cores used on average meanwhile (its CPU seconds / wall seconds)."""
    service.score(trajectories(2 * service.workers))  # warm-up: every worker has run once
    c0, t0 = cpu_s(), time.perf_counter()
    out = service.score(trajs)
    elapsed, cores = time.perf_counter() - t0, cpu_s() - c0
    assert all("reward_error" not in t.reward_info for t in out), "a call failed; see the log"
    return len(trajs) / elapsed, cores / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=120)
    ap.add_argument("--call-ms", type=float, default=50.0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    load_before = os.getloadavg()
    iterations, call_ms = calibrate(args.call_ms)
    trajs = trajectories(args.trajectories)
    kwargs = {"iterations": iterations}
    fn = load_reward(SPEC, kwargs)
    t0 = time.perf_counter()
    for t in trajs[:20]:
        fn(t)
    serial = 20 / (time.perf_counter() - t0)
    with RewardService(fn, timeout_s=60.0, workers=args.workers) as svc:
        threads, thread_cores = rate(svc, trajs)
    t0 = time.perf_counter()
    with ProcessRewardService(RewardSpec(SPEC, kwargs), timeout_s=60.0, workers=args.workers) as svc:
        start_s = time.perf_counter() - t0
        processes, process_cores = rate(svc, trajs)
    metrics = {"call_ms": call_ms, "serial_per_s": serial, "thread_per_s": threads, "process_per_s": processes,
               "process_vs_thread": processes / threads, "thread_cores_used": thread_cores,
               "process_cores_used": process_cores, "process_start_s": start_s, "iterations": iterations,
               "cpus": len(os.sched_getaffinity(0)), "loadavg_1m_before": load_before[0],
               "loadavg_1m_after": os.getloadavg()[0], "nice": os.nice(0)}
    print(f"reward throughput, {args.workers} workers, a {call_ms:.0f} ms pure-Python verifier: serial "
          f"{serial:.1f}/s, threads {threads:.1f}/s on {thread_cores:.2f} cores, processes {processes:.1f}/s on "
          f"{process_cores:.2f} cores ({processes / threads:.2f}x threads); process pool start {start_s:.2f}s; "
          f"load average {load_before[0]:.2f} before, {metrics['loadavg_1m_after']:.2f} after on "
          f"{metrics['cpus']} CPUs")
    print("appended to", append_record("reward_pool", metrics, config=vars(args), gpu=False))


if __name__ == "__main__":
    main()
