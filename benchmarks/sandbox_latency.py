"""Start-to-result latency of the Python sandbox on a trivial program.

    python benchmarks/sandbox_latency.py [--runs 50] [--warmup 3]

Times ``PythonSandbox.run("print(1)")`` (bubblewrap: namespaces, mounts, prlimit, setpriv,
interpreter start, output read, pid namespace torn down) ``--runs`` times, one after the
other, the same with ``unsafe=True`` (a plain subprocess that sets rlimits through ``runpy``
and a temporary folder) and a bare ``subprocess.run([python, "-B", "-c", "print(1)"])`` as the
references; prints p50 / p99 / mean / max in ms and appends one record to
``benchmarks/results/sandbox_cpu.jsonl``. Most of each number is the interpreter's start-up;
sandboxed minus bare is what the sandbox costs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

from conveyor.sandbox import PythonSandbox, SandboxLimits


def measure(run, runs: int, warmup: int) -> dict:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = run()
        times.append((time.perf_counter() - t0) * 1e3)
        if out != "1\n":
            raise RuntimeError(f"print(1) printed {out!r}")
    q = statistics.quantiles(times, n=100, method="inclusive")
    return {"p50_ms": statistics.median(times), "p99_ms": q[98], "mean_ms": statistics.fmean(times),
            "max_ms": max(times), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    limits = SandboxLimits()
    sb = PythonSandbox(limits)
    sandboxed = measure(lambda: sb.run("print(1)").stdout, args.runs, args.warmup)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unsafe reference warns by design
        unsafe_sb = PythonSandbox(limits, unsafe=True)
    unsafe = measure(lambda: unsafe_sb.run("print(1)").stdout, args.runs, args.warmup)
    bare = measure(lambda: subprocess.run([sys.executable, "-B", "-c", "print(1)"], capture_output=True,
                                          text=True, check=True).stdout, args.runs, args.warmup)
    for name, m in (("bwrap sandbox", sandboxed), ("unsafe mode", unsafe), ("bare interpreter", bare)):
        print(f"{name:18s} p50 {m['p50_ms']:6.1f} ms  p99 {m['p99_ms']:6.1f} ms  "
              f"mean {m['mean_ms']:6.1f} ms  max {m['max_ms']:6.1f} ms  ({m['runs']} runs)")
    from benchmarks.harness import append_record
    path = append_record("sandbox", {"sandboxed": sandboxed, "unsafe": unsafe, "bare": bare,
                                     "overhead_p50_ms": sandboxed["p50_ms"] - bare["p50_ms"]},
                         config={"program": "print(1)", "runs": args.runs, "warmup": args.warmup,
                                 "python": sys.version.split()[0], "euid": os.geteuid(),
                                 "cpu_count": os.cpu_count(), "limits": limits.__dict__},
                         gpu=False)
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
