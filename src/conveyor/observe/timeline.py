"""The role timeline: what every role did when, as a Chrome / Perfetto trace in ``timeline.json``.

- ``Timeline(run_dir, max_mb)`` writes ``run_dir/timeline.json`` (Trace Event Format, JSON
  array form): one process per role, one thread per track; spans and counters in wall-clock
  seconds. Only the controller's process writes the file: other processes send their spans.
- One recorder is active per process (``activate`` / ``deactivate``); the module functions
  ``record``, ``record_spans``, ``count``, ``measure`` and ``phase_span`` forward to it and do
  nothing when none is active.
- ``read_timeline(run_dir)`` / ``iter_timeline`` parse the file back, also a killed writer's.
- Memory stays bounded; past ``max_mb`` nothing more is written (the drop is counted).

It deliberately does not know what a span means or how steps are numbered:
callers name them (the five role names of ``Timeline`` only fix the order of the
processes). A span costs a few microseconds while a timeline is active.
"""
from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

TIMELINE_FILE = "timeline.json"
# Known roles get small, fixed process ids, so Perfetto lists them in this order.
ROLE_PIDS = {"controller": 1, "trainer": 2, "rollout": 3, "reward": 4, "environment": 5}
FLUSH_EVENTS = 4096
FLUSH_S = 2.0


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


def _stable_id(name: str, base: int) -> int:
    # From the name, not from the order of first use: a resumed run appends to the same file
    # and must give a track the id it had before.
    return base + zlib.crc32(name.encode("utf-8")) % 1_000_000


class Timeline:
    """Buffers trace events and appends them to ``timeline.json``; safe to call from any thread.

    ``Timeline(run_dir, max_mb)`` writes ``run_dir/timeline.json`` in the Trace
    Event Format's JSON array form, which ui.perfetto.dev and chrome://tracing
    open: one *process* per role (``controller``, ``trainer``, ``rollout``,
    ``reward``, ``environment``; another name gets a process of its own), one
    *thread* per track inside it (an engine, a trainer rank, a reward worker,
    an environment slot, the loop). ``span(role, track, name, start, end,
    args)`` is a complete ("X") event, ``counter(role, name, values, at)`` a
    counter ("C") event; times are wall-clock seconds (``time.time()``),
    written as whole microseconds (both ends rounded down, so spans that nest
    or follow each other still do). ``close()`` writes what waits and ends
    the array.

    Design (why it is this simple): only the controller's process writes the
    file. Roles in other processes never open it: an engine worker attaches the
    spans of its generate calls to the ``Done`` messages it sends anyway, a
    trainer rank its train and publish spans to its ``Trained`` answer
    (``transport.messages.Span``), and weight swaps are drawn from the
    timestamps of the ``WeightSwap`` reports; the controller records them as
    they arrive. Every process of a run shares one machine and so one wall
    clock, so nothing needs merging or clock alignment. Memory stays bounded:
    events wait in a list until ``FLUSH_EVENTS`` of them or ``FLUSH_S`` seconds
    have gathered, then are appended to the file; past ``max_mb`` nothing more
    is written and the number dropped is recorded in the file's last event. A
    resumed run appends to the same file (a killed writer's torn tail is cut
    first); process and thread ids are derived from the names, so they agree
    across the two.
    """

    def __init__(self, run_dir: str | Path, max_mb: float = 64.0) -> None:
        self.path = Path(run_dir) / TIMELINE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_mb * 2**20)
        self.dropped = 0
        self._lock = threading.Lock()
        self._io = threading.Lock()  # serialises file writes; never held while recording
        self._pending: list[tuple] = []
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[str, str], int] = {}
        self._names: dict[str, str] = {}  # span name -> its JSON text
        self._closed = False
        self._last_flush = time.monotonic()
        self.written, self._first = _reopen(self.path)

    # ----- recording ----------------------------------------------------------------
    def span(self, role: str, track: str, name: str, start: float, end: float,
             args: Mapping[str, Any] | None = None) -> None:
        """A complete event: ``name`` ran on ``role``/``track`` from ``start`` to ``end`` (wall seconds)."""
        self._add(("X", role, track, name, start, max(end, start), args))

    def counter(self, role: str, name: str, values: Mapping[str, float], at: float | None = None) -> None:
        """A counter track ``name`` of ``role`` takes ``values`` (series name -> number) at ``at``."""
        self._add(("C", role, "", name, time.time() if at is None else at, None, dict(values)))

    def _add(self, event: tuple) -> None:
        with self._lock:
            if self._closed:
                return
            self._pending.append(event)
            due = len(self._pending) >= FLUSH_EVENTS or time.monotonic() - self._last_flush >= FLUSH_S
        if due:
            self.flush()

    # ----- writing ------------------------------------------------------------------
    def flush(self) -> None:
        """Append what waits to the file (the caller's thread pays for the encoding)."""
        with self._io:
            with self._lock:
                events, self._pending = self._pending, []
                self._last_flush = time.monotonic()
            lines: list[str] = []
            for event in events:
                self._encode(event, lines)
            self._write(lines)

    def _encode(self, event: tuple, out: list[str]) -> None:
        """Append ``event``'s JSON text to ``out``, after the metadata of a role or track seen first."""
        ph, role, track, name, start, end, args = event
        pid = self._pids.get(role)
        if pid is None:
            pid = self._pids[role] = ROLE_PIDS.get(role) or _stable_id(role, 100)
            out.append(_json({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": role}}))
            out.append(_json({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                              "args": {"sort_index": pid}}))
        if ph == "C":
            out.append(_json({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": math.floor(start * 1e6),
                              "args": args}))
            return
        tid = self._tids.get((role, track))
        if tid is None:
            tid = self._tids[(role, track)] = _stable_id(track, 1)
            out.append(_json({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}}))
            out.append(_json({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                              "args": {"sort_index": len(self._tids)}}))
        # Whole microseconds, both ends rounded down: rounding by one non-decreasing function keeps
        # every order between ends, so spans that nest or follow each other still do (Perfetto
        # draws a thread's spans as a stack, and would cut a span overlapping its neighbour).
        ts = math.floor(start * 1e6)
        quoted = self._names.get(name)
        if quoted is None:  # spans repeat a few names: encode each once (most of a span's cost)
            quoted = self._names[name] = json.dumps(str(name))
        tail = f',"args":{_json(args)}}}' if args else "}"
        out.append(f'{{"ph":"X","name":{quoted},"pid":{pid},"tid":{tid},"ts":{ts},'
                   f'"dur":{math.floor(end * 1e6) - ts}{tail}')

    def _write(self, lines: list[str]) -> None:
        chunks = []
        for text in lines:
            line = ("" if self._first else ",") + text + "\n"
            size = len(line.encode("utf-8"))
            if self.written + size > self.max_bytes:
                self.dropped += 1
                continue
            chunks.append(line)
            self.written += size
            self._first = False
        if chunks:
            with self.path.open("a", encoding="utf-8") as f:
                f.write("".join(chunks))

    def close(self) -> None:
        """Write what waits and end the JSON array; later events are ignored. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        with self._io:
            end = {"ph": "M", "name": "timeline_end", "pid": 0, "tid": 0, "args": {"dropped": self.dropped}}
            line = ("" if self._first else ",") + json.dumps(end) + "\n]\n"
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line)


def _reopen(path: Path) -> tuple[int, bool]:
    """Prepare ``path`` for appending: start a new array, or reopen one a previous writer left
    (closed, or torn by a kill). Returns (bytes in the file, whether no event is in it yet)."""
    if not path.is_file() or path.stat().st_size == 0:
        path.write_text("[\n", encoding="utf-8")
        return 2, True
    raw = path.read_bytes()
    keep, events = 0, 0
    pos = 0
    for line in raw.split(b"\n")[:-1]:  # the last piece has no newline: torn, or empty
        end = pos + len(line) + 1
        text = line.strip().lstrip(b",")
        if pos == 0 and line.strip() == b"[":
            keep = end
        elif text and text != b"]":
            try:
                ev = json.loads(text)
            except ValueError:
                break
            if ev.get("name") != "timeline_end":  # a closed file's end mark: its run went on
                keep, events = end, events + 1
            else:
                break
        pos = end
    if keep == 0:  # not our file's shape: start it anew rather than append to garbage
        path.write_text("[\n", encoding="utf-8")
        return 2, True
    with path.open("rb+") as f:
        f.truncate(keep)
    return keep, events == 0


def read_timeline(run_dir: str | Path) -> list[dict[str, Any]]:
    """The events of ``run_dir/timeline.json``, in file order; a file whose writer was killed
    (no closing bracket, a torn last line) yields the events it completed.

    ``read_timeline(run_dir)`` (or ``iter_timeline``, one event at a time)
    parses the file back, also one whose writer was killed before ``close``.
    """
    return list(iter_timeline(run_dir))


def iter_timeline(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """``read_timeline`` one event at a time, for files too large to hold parsed at once."""
    path = Path(run_dir) / TIMELINE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {TIMELINE_FILE} in {run_dir}; the run recorded no timeline "
                                "(observe.timeline=false, or it ran before timelines existed)")
    return _events(path)


def _events(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            text = line.strip().lstrip(",")
            if not text or text in ("[", "]"):
                continue
            try:
                yield json.loads(text)
            except ValueError:
                return  # a torn last line


# ----- the process's active recorder ---------------------------------------------------
_active: Timeline | None = None


def activate(timeline: Timeline | None) -> None:
    """Make ``timeline`` the one the module functions record to (None: record nothing).

    One recorder is *active* per process (``activate`` / ``deactivate``; the
    metrics logger of a run does both). The module functions ``record``,
    ``record_spans``, ``count``, ``measure`` and ``phase_span`` forward to it
    and do nothing when none is active, so the places that report spans need
    no handle and cost one global read in runs without a timeline.
    """
    global _active
    _active = timeline


def deactivate(timeline: Timeline) -> None:
    """Stop recording to ``timeline`` if it is the active one (another may have replaced it)."""
    global _active
    if _active is timeline:
        _active = None


def active() -> Timeline | None:
    return _active


def record(role: str, track: str, name: str, start: float, end: float,
           args: Mapping[str, Any] | None = None) -> None:
    tl = _active
    if tl is not None:
        tl.span(role, track, name, start, end, args)


def record_spans(role: str, spans: Iterable[Any]) -> None:
    """Record ``transport.messages.Span``s another process measured, under ``role``."""
    tl = _active
    if tl is not None:
        for s in spans:
            tl.span(role, s.track, s.name, s.start, s.end, s.args)


def count(role: str, name: str, values: Mapping[str, float]) -> None:
    tl = _active
    if tl is not None:
        tl.counter(role, name, values)


@contextlib.contextmanager
def measure(role: str, name: str, track: str | None = None,
            args: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Record the ``with`` block as a span (also when it raises); ``track`` defaults to the
    current thread's name."""
    if _active is None:
        yield
        return
    start = time.time()
    try:
        yield
    finally:
        record(role, track or thread_track(), name, start, time.time(), args)


def phase_span(name: str, seconds: float) -> None:
    """``PhaseTimer``'s ``on_span``: a phase of the controller that just ended after ``seconds``."""
    if _active is not None:
        end = time.time()
        record("controller", thread_track(), name, end - seconds, end)


def thread_track() -> str:
    name = threading.current_thread().name
    return "loop" if name == "MainThread" else name


def pid_of(role: str) -> int:
    """The process id ``role`` has in the file (what a reader matches ``process_name`` against)."""
    return ROLE_PIDS.get(role) or _stable_id(role, 100)


__all__ = ["TIMELINE_FILE", "Timeline", "activate", "active", "count", "deactivate", "measure", "phase_span",
           "iter_timeline", "pid_of", "read_timeline", "record", "record_spans", "thread_track"]
