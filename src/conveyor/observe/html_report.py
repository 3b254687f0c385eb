"""One self-contained HTML page about a run: ``conveyor report RUN_DIR`` writes ``RUN_DIR/report.html``.

- ``write_report(run_dir, steps=None, out=None)`` writes the page and returns its path;
  ``collect`` is its data as plain JSON, ``render`` the HTML. A part the run did not record
  becomes a note in its place, never an error; ``ReportError``: not a run directory.
- The page needs no network, and no text of the run (a completion) can become markup: the data
  is escaped JSON that the inline script ``html_report.js`` draws through ``textContent``.

It knows the names of the metrics the loop logs (``reward``, ``response_len*``,
``staleness_hist/*``, ``*_idle_frac``, ``samples_per_s``, ``time/*``) and the
shape of the timeline's events; nothing of how they were computed.
"""
from __future__ import annotations

import html
import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from conveyor.observe.report import METRICS_FILE, SUMMARY_FILE, json_safe, read_metrics, read_summary
from conveyor.observe.timeline import TIMELINE_FILE, iter_timeline
from conveyor.observe.traces import TRACES_FILE, read_traces

REPORT_FILE = "report.html"
SCRIPT = Path(__file__).with_name("html_report.js")
OVERVIEW_PX = 1200  # the overview's width: spans closer than one pixel are drawn as one
MAX_RECTS = 40_000  # spans drawn in all (overview + close-up), so a long run's page stays small
CLOSEUP_STEPS = 3
CONFIG_KEYS = ("data.source", "model.path", "loop.steps", "loop.batch_size", "rollout.n", "loop.max_staleness",
               "algo.advantage", "algo.loss", "launch.engines", "launch.trainer_ranks")


class ReportError(ValueError):
    """The report cannot be made (not a run directory, bad ``--steps``); the message says why and the fix."""


def write_report(run_dir: str | Path, steps: list[int] | None = None, out: str | Path | None = None) -> Path:
    """``write_report(run_dir, steps=None, out=None)`` reads the run directory's
    files and writes the page (default ``run_dir/report.html``), returning its
    path. The page holds: the held-out table, the reward and held-out curves,
    the staleness histogram, completion lengths over the steps, throughput and
    idle fractions per role, the role timeline (``timeline.json``: the whole
    run, the last training steps up close, each track's busy share) and sample
    completions (best, worst, random) of the traced ``steps`` (default: the
    first, middle and last traced step).
    """
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    path = Path(out) if out is not None else run_dir / REPORT_FILE
    path.write_text(render(collect(run_dir, steps)), encoding="utf-8")
    return path


def check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; give the run directory `conveyor train` wrote "
                          "(runs/<name>-<time>, or its --output-dir)")
    if not ((run_dir / "config.yaml").is_file() or (run_dir / METRICS_FILE).is_file()):
        raise ReportError(f"{run_dir} is not a run directory (no config.yaml or {METRICS_FILE} in it); give the "
                          "directory `conveyor train` wrote (runs/<name>-<time>, or its --output-dir)")


# ----- the page's data ---------------------------------------------------------------------
def collect(run_dir: Path, steps: list[int] | None = None) -> dict[str, Any]:
    """Everything the page shows, as plain JSON data (``notes``: what is missing and why).

    ``collect(run_dir, steps)`` is the page's data as plain JSON; ``render(data)``
    the HTML. A part the run did not record (no traces, no timeline, no
    evaluation, no summary) becomes a note in its place, never an error.
    ``ReportError``: ``run_dir`` is not a run directory (the message names it
    and the fix).
    """
    notes: dict[str, str] = {}
    try:
        records = read_metrics(run_dir)
    except FileNotFoundError:
        records, notes["metrics"] = [], f"no {METRICS_FILE}: the run logged no step"
    try:
        summary = read_summary(run_dir)
    except FileNotFoundError:
        summary, notes["summary"] = {}, f"no {SUMMARY_FILE}: the run has not finished (or stopped early)"
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if records and not train:
        notes["metrics"] = "no training step was logged"
    if not evals:
        notes["eval"] = "no held-out evaluation was logged"
    return json_safe({
        "run": run_dir.resolve().name, "path": str(run_dir.resolve()),
        "config": _config_lines(run_dir), "heldout": _heldout(summary), "totals": _totals(summary, train),
        "train": _series(train, ("reward", "reward_std", "samples_per_s", "trainer_idle_frac", "time/step",
                                 "time/wait", "time/prepare", "time/train", "response_len", "response_len_p50",
                                 "response_len_p99", "response_len_max", "truncated_frac", "staleness_mean")),
        "engines_idle": _engine_idle(train),
        "eval": _series(evals, ("eval_reward", "eval_sampled_reward", "eval_exact")),
        "staleness": _staleness(train),
        "timeline": _timeline(run_dir, notes),
        "samples": _samples(run_dir, steps, notes),
        "notes": notes,
    })


def _config_lines(run_dir: Path) -> list[list[str]]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return []
    import yaml
    cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    out = []
    for key in CONFIG_KEYS:
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out.append([key, str(node)])
    return out


def _heldout(summary: dict) -> list[dict]:
    """Rows of the held-out table: initial / warm-start / after RL, as the run's end prints them."""
    rows = []
    for label, key in (("greedy reward", "eval_reward"), ("sampled reward", "eval_sampled_reward"),
                       ("exact answers", "eval_exact")):
        vals = {p: summary.get(f"{key}_{p}") for p in ("initial", "warmstart", "final")}
        if any(v is not None for v in vals.values()):
            rows.append({"label": label, **vals})
    return rows


def _totals(summary: dict, train: list[dict]) -> list[list[Any]]:
    out = [["RL steps", summary.get("steps", train[-1]["step"] if train else None)],
           ["wall seconds", summary.get("wall_seconds")], ["RL seconds", summary.get("rl_seconds")],
           ["trained samples/s", summary.get("trained_samples_per_second")]]
    return [row for row in out if row[1] is not None]


def _series(records: list[dict], keys: tuple[str, ...]) -> dict[str, list]:
    """``{"step": [...], key: [...]}`` with None where a record lacks the key; keys no record has are left out."""
    out: dict[str, list] = {"step": [r["step"] for r in records]}
    for key in keys:
        if any(key in r for r in records):
            out[key] = [r.get(key) for r in records]
    return out


def _engine_idle(train: list[dict]) -> dict[str, list]:
    keys = sorted({k for r in train for k in r if re.fullmatch(r"engine\d+_idle_frac", k)},
                  key=lambda k: int(re.sub(r"\D", "", k)))
    return {k.removesuffix("_idle_frac"): [r.get(k) for r in train] for k in keys}


def _staleness(train: list[dict]) -> list[list]:
    """[versions behind, share of all trained samples] over the run (each step weighs the same)."""
    totals: dict[int, float] = {}
    for r in train:
        for k, v in r.items():
            if k.startswith("staleness_hist/") and v is not None:
                lag = int(k.split("/", 1)[1])
                totals[lag] = totals.get(lag, 0.0) + v
    n = max(len(train), 1)
    return [[lag, totals[lag] / n] for lag in sorted(totals)]


# ----- the timeline --------------------------------------------------------------------------
def _timeline(run_dir: Path, notes: dict[str, str]) -> dict[str, Any] | None:
    try:
        events = iter_timeline(run_dir)
    except FileNotFoundError:
        notes["timeline"] = f"no {TIMELINE_FILE}: the run recorded no timeline (observe.timeline=false)"
        return None
    tracks, names = _tracks(events)
    if not tracks:
        notes["timeline"] = f"{TIMELINE_FILE} holds no span"
        return None
    t0 = min(s[0] for t in tracks for s in t["spans"])
    t1 = max(s[0] + s[1] for t in tracks for s in t["spans"])
    lo, hi = _closeup_window(tracks, names, t0, t1)
    busy_lo, busy_hi = _rl_window(tracks, names, t0, t1)
    budget = MAX_RECTS // (2 * len(tracks)) + 1
    rows = []
    for t in tracks:
        spans = sorted(t["spans"], key=lambda s: (s[0], -s[1]))  # a parent before the spans inside it
        working = [s for s in spans if not names[s[2]].startswith("wait")]
        rows.append({"role": t["role"], "track": t["track"], "count": len(spans),
                     "busy": _busy_share(working, busy_lo, busy_hi),
                     "overview": _merged(spans, t0, (t1 - t0) / OVERVIEW_PX, budget),
                     "closeup": _merged([s for s in spans if s[0] < hi and s[0] + s[1] > lo], lo,
                                        (hi - lo) / (4 * OVERVIEW_PX), budget)})
    return {"names": names, "tracks": rows, "span_s": t1 - t0, "closeup": [lo - t0, hi - lo],
            "closeup_steps": CLOSEUP_STEPS, "busy_window": [busy_lo - t0, busy_hi - busy_lo]}


def _tracks(events: Iterable[dict]) -> tuple[list[dict], list[str]]:
    """Complete events grouped by (process, thread), named by the metadata events, in the file's order
    of processes and threads: [{role, track, spans: [[start_s, dur_s, name_index], ...]}], names.
    One pass, keeping only those numbers: a timeline can hold hundreds of thousands of events."""
    roles, threads, order = {}, {}, {}
    names: list[str] = []
    index: dict[str, int] = {}
    grouped: dict[tuple, list] = {}
    for ev in events:
        if ev.get("ph") == "M":
            key = (ev.get("pid"), ev.get("tid"))
            if ev.get("name") == "process_name":
                roles[ev["pid"]] = ev["args"]["name"]
            elif ev.get("name") == "thread_name":
                threads[key] = ev["args"]["name"]
            elif ev.get("name") == "thread_sort_index":
                order[key] = ev["args"]["sort_index"]
            continue
        if ev.get("ph") != "X":
            continue
        name = str(ev.get("name", ""))
        if name not in index:
            index[name] = len(names)
            names.append(name)
        grouped.setdefault((ev["pid"], ev["tid"]), []).append([ev["ts"] / 1e6, ev.get("dur", 0) / 1e6, index[name]])
    keys = sorted(grouped, key=lambda k: (k[0], order.get(k, 10**9), threads.get(k, "")))
    tracks = [{"role": roles.get(k[0], f"process {k[0]}"), "track": threads.get(k, f"thread {k[1]}"),
               "spans": grouped[k]} for k in keys]
    return tracks, names


def _closeup_window(tracks: list[dict], names: list[str], t0: float, t1: float) -> tuple[float, float]:
    """The last ``CLOSEUP_STEPS`` training steps: from the end of the controller's train span before
    them to the end of the last one (the whole timeline when the run trained fewer steps)."""
    trains = sorted(s[0] + s[1] for s in _controller_spans(tracks, names, "train"))
    if len(trains) > CLOSEUP_STEPS:
        return trains[-CLOSEUP_STEPS - 1], trains[-1]
    return t0, t1


def _rl_window(tracks: list[dict], names: list[str], t0: float, t1: float) -> tuple[float, float]:
    """RL: from the controller's first wait for a batch to its last train span's end."""
    waits = [s[0] for s in _controller_spans(tracks, names, "wait")]
    trains = [s[0] + s[1] for s in _controller_spans(tracks, names, "train")]
    return (min(waits), max(trains)) if waits and trains and max(trains) > min(waits) else (t0, t1)


def _controller_spans(tracks: list[dict], names: list[str], name: str) -> list[list]:
    """The spans called ``name`` on the controller's loop row (the loop's phases)."""
    if name not in names:
        return []
    i = names.index(name)
    for t in tracks:
        if t["role"] == "controller" and t["track"] == "loop":
            return [s for s in t["spans"] if s[2] == i]
    return []


def _busy_share(spans: list[list], lo: float, hi: float) -> float | None:
    """The share of [lo, hi] covered by at least one of ``spans`` (sorted by start; nested spans
    count once). The caller leaves out the waits, which are idle time however long they are."""
    if hi <= lo:
        return None
    covered, end = 0.0, lo
    for start, dur, _ in spans:
        a, b = max(start, end), min(start + dur, hi)
        if b > a:
            covered += b - a
            end = b
    return covered / (hi - lo)


def _merged(spans: list[list], origin: float, quantum: float, budget: int) -> list[list]:
    """[start, dur, name, depth, count] relative to ``origin``: neighbours of one name and depth
    closer than ``quantum`` drawn as one, the quantum doubled until at most ``budget`` remain."""
    depth_of = _depths(spans)
    while True:
        out: list[list] = []
        last: dict[tuple[int, int], list] = {}
        for (start, dur, name), depth in zip(spans, depth_of):
            key = (name, depth)
            prev = last.get(key)
            if prev is not None and start - origin - (prev[0] + prev[1]) < quantum:
                prev[1] = max(prev[1], start - origin + dur - prev[0])
                prev[4] += 1
                continue
            last[key] = [start - origin, dur, name, depth, 1]
            out.append(last[key])
        if len(out) <= budget or quantum <= 0:
            return [[round(a, 6), round(b, 6), n, d, c] for a, b, n, d, c in out]
        quantum *= 2


def _depths(spans: list[list]) -> list[int]:
    """Nesting depth of each span (sorted by start) among the spans of its track."""
    ends: list[float] = []
    out = []
    for start, dur, _ in spans:
        while ends and ends[-1] <= start:
            ends.pop()
        out.append(min(len(ends), 3))
        ends.append(start + dur)
    return out


# ----- sample completions ----------------------------------------------------------------------
def _samples(run_dir: Path, steps: list[int] | None, notes: dict[str, str]) -> list[dict]:
    try:
        traces = read_traces(run_dir)
    except FileNotFoundError:
        notes["samples"] = f"no {TRACES_FILE}: the run traced no completions (observe.traces_per_step=0)"
        return []
    traced = sorted({t["step"] for t in traces})
    if not traced:
        notes["samples"] = f"{TRACES_FILE} is empty"
        return []
    chosen = steps if steps else sorted({traced[0], traced[len(traced) // 2], traced[-1]})
    missing = [s for s in chosen if s not in traced]
    if missing:
        notes["samples"] = (f"no traces of step {', '.join(map(str, missing))}; traced steps: {traced[0]} to "
                            f"{traced[-1]} ({len(traced)} steps)")
    out = []
    for step in chosen:
        recs = [t for t in traces if t["step"] == step]
        if recs:
            out.append({"step": step, "samples": _pick(recs, step)})
    return out


def _pick(recs: list[dict], step: int) -> list[dict]:
    """The best and the worst by reward and one of the others at random (seeded by the step)."""
    order = sorted(range(len(recs)), key=lambda i: (recs[i].get("reward") is None, recs[i].get("reward") or 0.0))
    picked = [("best", order[-1])]
    if len(order) > 1:
        picked.append(("worst", order[0]))
    rest = order[1:-1]
    if rest:
        picked.append(("random", random.Random(f"report-{step}").choice(rest)))
    return [{"kind": kind, **_sample(recs[i])} for kind, i in picked]


def _sample(r: dict) -> dict:
    v = r.get("versions") or {}
    return {"reward": r.get("reward"), "finish": r.get("finish_reason"), "tokens": r.get("completion_tokens"),
            "versions": f"v{v['min']}" + (f"-v{v['max']}" if v["max"] != v["min"] else "") if v else "",
            "task": r.get("task_id"), "prompt": r.get("prompt", ""), "completion": r.get("completion", ""),
            "turns": len(r.get("turns") or []), "info": r.get("reward_info") or {}}


# ----- the page ----------------------------------------------------------------------------------
def embed_json(data: Any) -> str:
    """``data`` as JSON that is safe inside a <script> element: no character of it can close the
    element or open a comment, whatever the strings hold."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render(data: dict[str, Any]) -> str:
    """The page needs no network: the data sits in the page as JSON, with every
    ``<``, ``>`` and ``&`` escaped so no text (a completion) can end the script
    element, and the inline script ``html_report.js`` (beside this module)
    draws it as SVG, putting every text in through ``textContent``, never as
    markup. Once everything is drawn the script sets ``data-rendered="1"`` on
    ``<body>``; an error in a script is shown at the top of the page and
    counted in ``data-errors`` on ``<body>``.
    """
    title = html.escape(f"conveyor report: {data['run']}")
    return PAGE.format(title=title, data=embed_json(data), script=SCRIPT.read_text(encoding="utf-8"),
                       style=STYLE)


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d2430}
header{background:#1d2430;color:#fff;padding:14px 24px}header h1{font-size:20px;margin:0}
header p{margin:4px 0 0;color:#c5cbd6;font-size:13px}main{padding:16px 24px;max-width:1320px}
section{background:#fff;border:1px solid #e2e5ea;border-radius:6px;padding:12px 16px;margin:0 0 16px}
section h2{font-size:16px;margin:0 0 8px}.row{display:flex;flex-wrap:wrap;gap:16px}
.chart{flex:1 1 560px;min-width:420px;max-width:640px}.chart h3{font-size:13px;margin:4px 0;color:#444}
.note{color:#7a5b00;background:#fff8e1;border:1px solid #f3e0a3;padding:6px 10px;border-radius:4px}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #eceef2;padding:3px 10px;text-align:right}
th:first-child,td:first-child{text-align:left}.legend{font-size:12px;color:#333;margin:2px 0 6px}
.legend span{display:inline-block;margin-right:12px}.legend i{display:inline-block;width:10px;height:10px;
margin-right:4px;vertical-align:middle;border-radius:2px}svg text{font-size:11px;fill:#444}
pre{white-space:pre-wrap;word-break:break-word;background:#f3f4f7;padding:6px 8px;margin:2px 0;border-radius:4px;
font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,monospace}.sample{border-top:1px solid #eceef2;padding:6px 0}
.tag{display:inline-block;padding:0 6px;border-radius:3px;font-size:12px;color:#fff;margin-right:6px}
#errors{background:#fde8e8;color:#8a1010;padding:8px 24px}.muted{color:#667;font-size:12px}
"""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<div id="errors" hidden></div>
<script>
window.reportErrors = [];
window.onerror = function (message, source, line) {{
  var text = String(message) + " (line " + line + ")";
  window.reportErrors.push(text);
  var box = document.getElementById("errors");
  var p = document.createElement("p");
  p.textContent = "error while drawing this page: " + text;
  box.appendChild(p);
  box.hidden = false;
  document.body.setAttribute("data-errors", String(window.reportErrors.length));
}};
</script>
<header><h1 id="title"></h1><p id="subtitle"></p></header>
<main>
<noscript><p class="note">This page draws its charts with JavaScript; allow scripts for this file.</p></noscript>
<section id="overview"><h2>Run</h2></section>
<section id="rewards"><h2>Reward and held-out reward</h2></section>
<section id="rollouts"><h2>Rollouts: staleness and completion lengths</h2></section>
<section id="throughput"><h2>Throughput and idle time per role</h2></section>
<section id="timeline"><h2>Timeline of the roles</h2></section>
<section id="samples"><h2>Sample completions</h2></section>
</main>
<script type="application/json" id="report-data">{data}</script>
<script>
{script}
</script>
</body>
</html>
"""
