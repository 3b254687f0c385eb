"""Where a GPU waits for its host: idle gaps between kernels in a profiler trace, by host code.

    from benchmarks.gpu_gaps import idle_report
    with torch.profiler.profile(activities=[CPU, CUDA], with_stack=True) as prof: ...
    prof.export_chrome_trace(path); print(idle_report(path))

Contract: ``idle_report(trace_path, top=15, min_us=5.0) -> str`` reads a Chrome trace written by
``torch.profiler`` (kernels, memcpy and memset on the device; CPU ops, runtime calls and, with
``with_stack=True``, Python frames on the host) and sums the device's idle time between one
device event's end and the next one's start, for gaps of at least ``min_us``. A gap is
*host-late* when the next device event was launched after the previous one had ended (the
queue ran dry), otherwise *device-side* (launched in time, started late: a dependency or a
synchronising copy). Host-late time is attributed to what the launching thread was doing at
the middle of the gap: its innermost frame from a ``conveyor`` source file, and its innermost
operator (``aten::item`` is a synchronising read). The profiler slows the host, so the gap
total overstates the idle time of an unprofiled step; the split by code is what it is for.
"""
from __future__ import annotations

import bisect
import json
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "python_function", "user_annotation"}


def _innermost(spans: list[tuple[float, float, str]], starts: list[float], t: float, keep) -> str:
    """Name of the shortest span containing ``t`` whose name passes ``keep`` ('-' if none)."""
    best, best_len = "-", float("inf")
    i = bisect.bisect_right(starts, t)
    # spans are sorted by start; an enclosing span starts at or before t. Scan back while it may still contain t.
    for j in range(i - 1, max(-1, i - 4000), -1):
        s, e, name = spans[j]
        if s <= t <= e and (e - s) < best_len and keep(name):
            best, best_len = name, e - s
    return best


def _short(frame: str) -> str:
    # "conveyor/trainer/single.py(452): _backward" -> "trainer/single.py:452 _backward"
    path, _, rest = frame.partition("(")
    line, _, func = rest.partition("):")
    path = path.split("conveyor/", 1)[-1]
    return f"{path}:{line} {func.strip()}"


def idle_report(trace_path: str, top: int = 15, min_us: float = 5.0) -> str:
    events = json.load(open(trace_path)).get("traceEvents", [])
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    if not device:
        return "no device events in the trace"
    launch_at = {e["args"]["correlation"]: (e["ts"] + e.get("dur", 0), e.get("tid"))
                 for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    frames = defaultdict(list)  # tid -> [(start, end, name)]
    ops = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATS and "dur" in e:
            span = (e["ts"], e["ts"] + e["dur"], e.get("name", "?"))
            (frames if e["cat"] == "python_function" else ops)[e.get("tid")].append(span)
    index = {}
    for table in (frames, ops):
        for tid, spans in table.items():
            spans.sort()
            index[(id(table), tid)] = [s for s, _, _ in spans]
    busy = sum(e["dur"] for e in device)
    first, end = device[0]["ts"], device[0]["ts"] + device[0]["dur"]
    host_late, device_side = defaultdict(lambda: [0.0, 0]), 0.0
    for e in device[1:]:
        gap = e["ts"] - end
        if gap >= min_us:
            corr = e.get("args", {}).get("correlation")
            launched, tid = launch_at.get(corr, (None, None))
            if launched is not None and launched > end:
                mid = end + gap / 2
                fr = frames.get(tid, [])
                op = ops.get(tid, [])
                where = _innermost(fr, index.get((id(frames), tid), []), mid, lambda n: "conveyor/" in n)
                what = _innermost(op, index.get((id(ops), tid), []), mid, lambda n: True)
                key = (_short(where) if where != "-" else "-", what)
                host_late[key][0] += gap
                host_late[key][1] += 1
            else:
                device_side += gap
        end = max(end, e["ts"] + e["dur"])
    span = end - first
    late = sum(v[0] for v in host_late.values())
    lines = [f"device span {span / 1e3:.1f} ms: busy {busy / 1e3:.1f} ms, idle in gaps >= {min_us:g} us: "
             f"host-late {late / 1e3:.1f} ms, device-side {device_side / 1e3:.1f} ms",
             f"{'ms':>8} {'gaps':>6}  conveyor frame | innermost op (host-late gaps, by where the host was)"]
    for (where, what), (t, n) in sorted(host_late.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{t / 1e3:8.2f} {n:6d}  {where} | {what}")
    return "\n".join(lines)
