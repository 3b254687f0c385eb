"""Run one configuration in a subprocess with a deadline, turn its files into a JSON row.

Contract
- ``run_subprocess(argv, run_dir, deadline_s)`` starts ``argv`` in its own
  process group (cwd = repository root, which is put on PYTHONPATH so
  ``benchmarks.*`` and the recording rewards import), sends its output to
  ``run_dir/stdout.log`` and ``stderr.log`` (``threads`` sets OMP/MKL
  intra-op threads in its environment), and returns ``{"status": "ok" |
  "failed" | "timeout", "rc", "wall_s", "error"}``. A child past its deadline
  gets SIGTERM, then SIGKILL, with its whole group; ``error`` is the last
  exception-looking line of stderr. It never raises for the child's sake:
  a crashing or hanging peer (exception, CUDA assert, OOM kill) is a row.
- ``run_peer(spec, deadline_s)`` writes ``spec.json`` and runs
  ``benchmarks.peers.<system>_peer`` on it.
- ``collect(spec, outcome, ...)`` builds the per-configuration record:
  identity, status, machine and versions (the child's, else the parent's
  view), seeds, config digest, ``metrics.summarize`` output, bounds for the
  device and model, and for W2 the evaluation of the shared starting
  checkpoint (passed in) and of the run's final one.
- ``evaluate_start(spec, out_dir, deadline_s)`` evaluates the starting
  checkpoint once, in a subprocess, with ``benchmarks.evaluate``.
- ``write_record`` writes ``<out>/<name>.json``; ``append_row`` appends
  one markdown row to a table, writing the header when the file is new.
  Both go to the run directory (``--out``, outside git).
- ``append_record(workload, metrics, ...)`` appends ONE summary line
  (command, commit, card, date, config, metrics) to the workload's results
  file, ``benchmarks/results/<workload>.jsonl`` (``<workload>_cpu.jsonl``
  when the card is this machine's CPU); every benchmark script calls it once
  per configuration it measures. ``CONVEYOR_BENCH_RESULTS`` names another
  folder (tests use it). ``record_run`` does it for a harness record.

It does not know what a workload is beyond the spec keys it copies.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from benchmarks import bounds as B
from benchmarks import metrics as M
from benchmarks.workloads import TRAJECTORIES, run_config, samples_per_step

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
_ERROR_MARKERS = ("Error", "Exception", "error:", "assert", "Killed", "CUDA")


def _env(threads: int | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads:
        # torch reads these at start-up; every system gets the same intra-op thread count.
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def _last_error(stderr_path: Path) -> str:
    try:
        lines = [l.strip() for l in stderr_path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if any(m in line for m in _ERROR_MARKERS) and not line.startswith("warnings.warn"):
            return line[:300]
    return lines[-1][:300] if lines else ""


def run_subprocess(argv: list[str], run_dir: Path, deadline_s: float, threads: int | None = None) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (run_dir / "stdout.log").open("w") as out, (run_dir / "stderr.log").open("w") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, env=_env(threads),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=deadline_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, status = proc.returncode, "timeout"
    wall = time.perf_counter() - t0
    error = f"no result within the {deadline_s:.0f}s deadline" if status == "timeout" else \
        _last_error(run_dir / "stderr.log") if status == "failed" else ""
    return {"status": status, "rc": rc, "wall_s": wall, "error": error}


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_peer(spec: dict, deadline_s: float) -> dict:
    run_dir = Path(spec["run_dir"])
    # A re-run starts clean: the logs are appended to, and old lines would join the new run's.
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    outcome = _settle(run_subprocess([sys.executable, "-m", f"benchmarks.peers.{spec['system']}_peer",
                                      str(spec_path)], run_dir, deadline_s, spec.get("cpu_threads")), run_dir)
    (run_dir / "outcome.json").write_text(json.dumps(outcome, indent=2) + "\n")
    return outcome


def _settle(outcome: dict, run_dir: Path) -> dict:
    outcome = dict(outcome)
    done = (run_dir / "result.json").is_file()
    if outcome["status"] == "ok" and not done:
        outcome.update(status="failed", error="peer exited 0 without writing result.json")
    elif outcome["status"] == "failed" and done and not outcome.get("error", "").startswith("exit code"):
        # The run finished and reported; only the interpreter's exit failed (e.g. a C++ thread
        # torn down at shutdown). The numbers stand; the row says what happened.
        outcome.update(status="ok", error=f"exit code {outcome.get('rc')} after result.json: {outcome['error']}")
    return outcome



def run_peer_module(module: str, spec: dict, deadline_s: float) -> dict:
    """One configuration of a workload module's own (W3, W4) in a subprocess ``python -m <module>
    --peer SPEC.json``, in a run directory started clean; returns and writes its outcome."""
    run_dir = Path(spec["run_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)  # a re-run starts clean: the logs are appended to
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2) + "\n")
    outcome = _settle(run_subprocess([sys.executable, "-m", module, "--peer", str(spec_path)],
                                     run_dir, deadline_s, spec.get("cpu_threads")), run_dir)
    (run_dir / "outcome.json").write_text(json.dumps(outcome, indent=2) + "\n")
    return outcome


def conveyor_peer_main(workload_config: Callable[[dict], object], spec_path: str) -> int:
    """The subprocess of such a configuration: ``peers/conveyor_peer.py`` on the workload's RunConfig."""
    from benchmarks.peers import conveyor_peer
    conveyor_peer.run_config = workload_config
    sys.argv = [sys.argv[0], spec_path]
    return conveyor_peer.main()

def recollect(out_dir: Path, threshold: float | None = None) -> list[dict]:
    """Rebuild every record under ``out_dir`` from the run directories' files, in run order.

    For re-deriving rows after a change to ``metrics.py`` without re-running anything; the
    subprocess outcome comes from ``outcome.json`` (or the earlier record when that is missing).
    """
    out_dir = Path(out_dir)
    start = out_dir / "eval_start" / "eval.json"
    before = json.loads(start.read_text()) if start.is_file() else None
    specs = sorted((p for p in out_dir.glob("*/spec.json") if p.parent.name != "eval_start"),
                   key=lambda p: p.stat().st_mtime)
    records = []
    for sp in specs:
        spec = json.loads(sp.read_text())
        oc, old = sp.parent / "outcome.json", out_dir / f"{spec['name']}.json"
        if oc.is_file():
            outcome = json.loads(oc.read_text())
        elif old.is_file():
            r = json.loads(old.read_text())
            outcome = {"status": r["status"], "error": r.get("error", ""), "wall_s": r.get("subprocess_wall_s")}
        else:
            continue
        outcome = _settle(outcome, sp.parent)
        rec = collect_safely(spec, outcome, threshold=threshold, eval_before=before)
        if old.is_file():  # keep what the workload script added (calibration, model name)
            prev = json.loads(old.read_text())
            rec.update({k: prev[k] for k in ("calibration", "model") if k in prev})
        records.append(rec)
    return records


def evaluate_start(spec: dict, out_dir: Path, deadline_s: float) -> dict:
    run_dir = Path(out_dir) / "eval_start"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, run_dir=str(run_dir))
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=2) + "\n")
    out = run_dir / "eval.json"
    outcome = run_subprocess([sys.executable, "-m", "benchmarks.evaluate", str(run_dir / "spec.json"),
                              spec["model_path"], str(out)], run_dir, deadline_s, spec.get("cpu_threads"))
    if outcome["status"] != "ok" or not out.is_file():
        raise RuntimeError(f"evaluating the starting checkpoint failed ({outcome['status']}): {outcome['error']}; "
                           f"see {run_dir}/stderr.log")
    return json.loads(out.read_text())


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a killed writer
    return out


def shape_of(model_path: str | Path) -> tuple[B.Shape, int]:
    """The decoder shape and bytes per parameter of a checkpoint, from its config.json."""
    c = json.loads((Path(model_path) / "config.json").read_text())
    heads = c["num_attention_heads"]
    shape = B.Shape(hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
                    kv_heads=c.get("num_key_value_heads") or heads,
                    head_dim=c.get("head_dim") or c["hidden_size"] // heads, ffn=c["intermediate_size"],
                    vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings")),
                    max_positions=c.get("max_position_embeddings", 0))
    dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
    return shape, 4 if "32" in dtype else 2


def collect(spec: dict, outcome: dict, threshold: float | None = None, eval_before: dict | None = None) -> dict:
    run_dir = Path(spec["run_dir"])
    result = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").is_file() else {}
    machine = result.get("machine") or {"device": B.device_name_no_cuda_init(), "versions": B.versions(),
                                        "device_kind": "unknown (peer did not report)"}
    cfg = run_config(spec)
    sps = samples_per_step(cfg)
    steps = [r for r in _read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    trajs = [t for t in _read_jsonl(run_dir / TRAJECTORIES) if t.get("split", "train") == "train"]
    shape, bpp = shape_of(spec["model_path"])
    recompute = cfg.algo.loss == "decoupled_ppo" or cfg.algo.importance_sampling != "none"
    bnd = B.bounds(shape, machine["device"], batch=sps, context=M.mean_decode_context(trajs) or 0.0,
                   bytes_per_param=bpp, recompute=recompute)
    summary = M.summarize(steps, trajs, sps, cap=cfg.rollout.max_new_tokens,
                          rl_start_unix=result.get("rl_start_unix"), threshold=threshold,
                          # Training tokens/s sums every trainer rank: MFU is per trainer GPU.
                          n_params=bnd["params"], recompute=recompute,
                          peak_flops=bnd["peak_flops"] * cfg.launch.trainer_ranks if bnd["peak_flops"] else None,
                          decode_bound=bnd["decode_bound_tokens_per_s"])
    rec = {
        "name": spec["name"], "workload": spec["workload"], "system": spec["system"],
        "setting": spec.get("setting", {}), "status": outcome["status"], "error": outcome.get("error", ""),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": machine["device"], "device_kind": machine.get("device_kind"), "versions": machine["versions"],
        "seeds": {"loop": cfg.loop.seed, "data": cfg.data.seed, "reward": spec.get("reward_seed", 0),
                  "model": spec.get("model_seed")},
        "config": {"samples_per_step": sps, "batch_size": cfg.loop.batch_size, "group": cfg.rollout.n,
                   "max_new_tokens": cfg.rollout.max_new_tokens, "lr": cfg.trainer.lr,
                   "eos_bias": cfg.rollout.eos_bias, "loss_agg": cfg.algo.loss_agg, "budget_s": spec.get("budget_s"),
                   "max_steps": spec.get("max_steps"), "model_path": spec["model_path"]},
        "cpu_threads": spec.get("cpu_threads"), "torch_threads": machine.get("torch_threads"),
        "subprocess_wall_s": outcome["wall_s"], "rl_seconds": result.get("rl_seconds"),
        "lengths": summary.pop("lengths"), "bounds": bnd, "metrics": summary,
    }
    if spec["workload"] == "w2":
        before, after = eval_before or {}, result.get("eval_after") or {}
        rec["eval"] = {"before": before.get("eval_reward"), "after": after.get("eval_reward"),
                       "delta": (after["eval_reward"] - before["eval_reward"])
                       if "eval_reward" in before and "eval_reward" in after else None,
                       "exact_before": before.get("eval_exact"), "exact_after": after.get("eval_exact")}
    if "cuda_max_memory_allocated_gb" in result:
        rec["cuda_max_memory_allocated_gb"] = result["cuda_max_memory_allocated_gb"]
    return rec


def collect_safely(spec: dict, outcome: dict, **kw) -> dict:
    """``collect``, or a bare failed record when even that fails: a sweep never dies on one row."""
    try:
        return collect(spec, outcome, **kw)
    except Exception as e:  # noqa: BLE001 - the row reports it
        empty = {"steps": 0, "trained_samples_per_s": None, "median_step_s": None, "rollout_tokens_per_s": None,
                 "training_tokens_per_s": None, "mbu": None, "mfu": None, "engine_idle_frac": None,
                 "trainer_idle_frac": None, "weight_sync_ms": None, "time_to_threshold_s": None,
                 "staleness": {"histogram": {}}}
        return {"name": spec["name"], "workload": spec["workload"], "system": spec["system"],
                "setting": spec.get("setting", {}), "status": "failed",
                "error": f"{outcome.get('error') or ''} / collecting: {type(e).__name__}: {e}"[:300],
                "device": B.device_name_no_cuda_init(), "versions": B.versions(),
                "seeds": {"loop": spec.get("seed")}, "config": {"lr": spec.get("lr")}, "rl_seconds": None,
                "metrics": empty, "lengths": M.length_stats([]), "bounds": {}, "eval": {}}


def load_done(out_dir: Path, name: str) -> dict | None:
    """The record of a configuration that already finished ok (for resuming a sweep), else None."""
    path = Path(out_dir) / f"{name}.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    return rec if rec.get("status") == "ok" else None


def write_record(out_dir: Path, rec: dict) -> Path:
    from conveyor.observe.report import json_safe
    path = Path(out_dir) / f"{rec['name']}.json"
    path.write_text(json.dumps(json_safe(rec), indent=2) + "\n")
    return path


def fmt(v, digits: int = 3, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    if pct:
        return f"{100 * v:.1f}%"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def append_row(table: Path, columns: list[tuple[str, Callable[[dict], str]]], rec: dict) -> str:
    cells = [fn(rec) for _, fn in columns]
    row = "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"
    new = not table.is_file() or table.stat().st_size == 0
    table.parent.mkdir(parents=True, exist_ok=True)
    with table.open("a", encoding="utf-8") as f:
        if new:
            f.write("| " + " | ".join(h for h, _ in columns) + " |\n")
            f.write("|" + "|".join("---" for _ in columns) + "|\n")
        f.write(row + "\n")
    return row


def status_cell(rec: dict) -> str:
    if rec["status"] == "ok":
        return f"ok ({rec['error'][:60]})" if rec.get("error") else "ok"
    return f"{rec['status'].upper()}: {rec.get('error', '')[:120]}"


def results_path(workload: str, gpu: bool) -> Path:
    folder = Path(os.environ.get("CONVEYOR_BENCH_RESULTS") or RESULTS)
    return folder / f"{workload}{'' if gpu else '_cpu'}.jsonl"


def append_record(workload: str, metrics: dict, *, config: dict | None = None, name: str | None = None,
                  card: str | None = None, gpu: bool | None = None) -> Path:
    """Append one run's summary to its workload's results file; returns the file.

    ``card``: the device the work ran on (``torch.cuda.get_device_name()``); by default the CPU
    model when ``gpu`` is False, else the first GPU as nvidia-smi names it (no CUDA context in
    this process), else the CPU model. ``gpu``: whether the card is a GPU (default: the card is
    not this machine's CPU). Summary metrics only:
    per-step logs stay in the run directory.
    """
    card = card or (B.cpu_name() if gpu is False else B.device_name_no_cuda_init())
    gpu = card != B.cpu_name() if gpu is None else gpu
    argv = list(sys.argv)
    if argv and argv[0]:
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
        except ValueError:
            pass
    rec = {"workload": workload, "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
           "commit": B._git_rev(), "card": card, "command": shlex.join(["python", *argv])}
    if name:
        rec["name"] = name
    rec["config"] = config or {}
    rec["metrics"] = metrics
    path = results_path(workload, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    return path


def record_run(rec: dict) -> Path:
    """``append_record`` for a harness record (W1, W2): its summary, without the per-step curve."""
    config = {"system": rec["system"], "setting": rec.get("setting", {}), "seed": rec.get("seeds", {}).get("loop"),
              "model": rec.get("model"), "status": rec["status"], "error": rec.get("error", ""),
              **{k: v for k, v in rec.get("config", {}).items() if k != "model_path"}}
    metrics = {k: v for k, v in rec.get("metrics", {}).items() if k != "curve"}
    metrics["lengths"] = rec.get("lengths")
    for k in ("eval", "rl_seconds", "cuda_max_memory_allocated_gb"):
        if rec.get(k) is not None:
            metrics[k] = rec[k]
    kind = rec.get("device_kind")
    return append_record(rec["workload"], metrics, config=config, name=rec["name"], card=rec.get("device"),
                         gpu=kind == "cuda" if kind in ("cuda", "cpu") else None)

def add_run_args(p) -> None:
    """The command-line options every workload script shares: deadlines, seeds, overrides, output."""
    p.add_argument("--budget-s", type=float, default=None, help="optional wall cap on each run's RL")
    p.add_argument("--deadline-s", type=float, default=3600.0, help="kill a configuration after this long")
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], help="conveyor key=value for every run")
    p.add_argument("--sync-override", action="append", default=[],
                   help="conveyor key=value for the synchronous run only (e.g. its placement)")
    p.add_argument("--async-override", action="append", default=[],
                   help="conveyor key=value for the streaming runs only (e.g. launch.placement=disaggregated)")
    p.add_argument("--table", default=None)
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="intra-op threads of every child (OMP/MKL); on a shared CPU, 1 keeps timings sane")
    p.add_argument("--recollect", action="store_true",
                   help="run nothing: rebuild OUT's JSON records and table.md from its run directories")
