"""Weight sync alone: one publish of a W1 model's weights by NCCL broadcast to N engine processes.

    python benchmarks/weight_sync_gpu.py --model qwen2.5-0.5b --engines 1 --out runs/sync   # GPU 0 -> 1..N
    python benchmarks/weight_sync_gpu.py --model tiny --backend gloo --out runs/sync-cpu   # CPU smoke

The writer (this process, GPU 0) holds the weights the way the single-device trainer
does, float32 masters and a bf16 compute copy, and publishes them as the RL loop does
(``publish_all(..., wait=False)``): ``--source float32`` casts the masters into the
buckets, ``bfloat16`` copies the compute copy, ``mixed`` is what the single-device
trainer hands over (the bf16 copies of the layers' linear weights, float32 for the
rest). Each engine process (GPU i) receives in its thread and applies every version to
its own copy of the weights, as an engine's weight watcher does (woken by
``wait_news``, stamped once the copy has run). Reported per source: publish ms (the
trainer's side, what ``weight_publish_ms`` logs in the loop: the copies and sends are
queued and the trainer trains on), sent ms (until the root's sends end) and, per engine,
announce -> received ms (the whole version in the engine's staging buckets) and announce
-> applied ms (copied into the engine: the end-to-end weight sync of an engine that is
not decoding); median, p10 and p90 over ``--reps``.
One JSON per run in ``--out``. No model weights are needed: the shapes come from the
configuration (random values).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def specs_of(shape_name: str) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.models import w1_config
    config = w1_config(shape_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    named = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    # The built-in engine ties the output embedding itself: it is not sent (as in the loop).
    return [(n, s) for n, s in named if not (config.tie_word_embeddings and n == "lm_head.weight")]


class _Engine:
    """Keeps its own copy of the weights, as an engine does (allocated on the first version)."""

    def __init__(self):
        self.own, self.version = None, 0

    def update_weights(self, items, version):
        import torch
        items = list(items)
        if self.own is None:
            self.own = {n: torch.empty_like(t) for n, t in items}
        # One foreach copy, as NativeEngine.update_weights does.
        torch._foreach_copy_([self.own[n] for n, _ in items], [t for _, t in items])
        self.version = version


def _engine(bw, engine_id: int, versions: int, device: str, out) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:  # processes sharing the cores: one thread each (spinning OpenMP threads of several slow all)
        torch.set_num_threads(1)
    engine, applied = _Engine(), []
    deadline = time.monotonic() + 600
    bw.poll(engine, engine_id)  # starts the receiver
    while len(applied) < versions and time.monotonic() < deadline:
        bw.wait_news(engine, 1.0)
        v = bw.poll(engine, engine_id)
        if v is not None:
            if device.startswith("cuda"):
                torch.cuda.current_stream().synchronize()  # the copy has run: the engine serves v
            applied.append((v, time.time(), bw.received_at))
    out.put((engine_id, applied))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    p.add_argument("--bucket-mb", type=float, default=128.0)
    p.add_argument("--source", default="all", choices=["float32", "bfloat16", "mixed", "all"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="runs/weight-sync")
    p.add_argument("--profile", action="store_true",
                   help="also write a torch profiler table (host time per op) of one more publish per source")
    args = p.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    from conveyor.launch.placement import free_port
    from conveyor.transport.broadcast import BroadcastWeights
    from conveyor.transport.weights import publish_all
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    gpu = backend == "nccl"
    if gpu and torch.cuda.device_count() < args.engines + 1:
        raise SystemExit(f"--engines {args.engines} needs {args.engines + 1} GPUs, "
                         f"{torch.cuda.device_count()} visible; lower --engines")
    dtype = torch.bfloat16
    specs = specs_of(args.model)
    sources = ["float32", "bfloat16", "mixed"] if args.source == "all" else [args.source]
    versions = len(sources) * (args.reps + 2 + int(args.profile))
    ctx = mp.get_context("spawn")
    bw = BroadcastWeights([(n, s, dtype) for n, s in specs], ctx, engines=args.engines, backend=backend,
                          dtype=dtype, port=free_port(), bucket_mb=args.bucket_mb, timeout_s=300)
    out = ctx.Queue()
    procs = [ctx.Process(target=_engine, args=(bw, i, versions, f"cuda:{i + 1}" if gpu else "cpu", out),
                         daemon=True) for i in range(args.engines)]
    for pr in procs:
        pr.start()
    device = torch.device("cuda:0" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    gen = torch.Generator(device=device).manual_seed(0)
    masters = [(n, torch.randn(s, generator=gen, device=device) * 0.02) for n, s in specs]
    copies = [(n, t.to(dtype)) for n, t in masters]
    linear = {n for n, s in specs if "layers." in n and n.endswith(".weight") and len(s) == 2}
    mixed = [(n, c if n in linear else m) for (n, m), (_, c) in zip(masters, copies)]
    results, sent, announced, measured, version = {}, {}, {}, {}, 0
    for source in sources:
        items = {"float32": masters, "bfloat16": copies, "mixed": mixed}[source]
        times, sent[source] = [], []
        for rep in range(args.reps + 2):  # the first two warm the group and the allocator
            version += 1
            if gpu:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            announced[version] = time.time()
            publish_all([bw], items, version, wait=False)
            t1 = time.perf_counter()
            bw._drain()  # the loop's trainer trains on meanwhile; here: when the root's sends end
            if rep >= 2:
                times.append((t1 - t0) * 1e3)
                sent[source].append((time.perf_counter() - t0) * 1e3)
                measured[version] = source
            time.sleep(0.05)  # the engines apply it (the next publish would wait for their receives)
        results[source] = times
        if args.profile:  # one more publish, profiled: where the trainer's host time goes
            from torch.profiler import ProfilerActivity, profile
            version += 1
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
            with profile(activities=activities) as prof:
                publish_all([bw], items, version, wait=False)
                bw._drain()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"weight-sync-{args.model}-{source}-profile.txt").write_text(table)
            time.sleep(0.05)
    applied = dict(out.get(timeout=600) for _ in procs)
    for pr in procs:
        pr.join(30)
    bw.close()

    def summary(xs):
        xs = sorted(xs)
        if not xs:
            return {}
        return {"median": statistics.median(xs), "p10": xs[len(xs) // 10], "p90": xs[(9 * len(xs)) // 10]}
    record = {"model": args.model, "engines": args.engines, "backend": backend, "bucket_mb": args.bucket_mb,
              "bytes": sum(torch.Size(s).numel() for _, s in specs) * 2, "tensors": len(specs),
              "device": torch.cuda.get_device_name(0) if gpu else "cpu", "date": time.strftime("%Y-%m-%d"),
              "publish_ms": {src: summary(ts) for src, ts in results.items()},
              "sent_ms": {src: summary(ts) for src, ts in sent.items()},
              "received_ms": {src: {str(e): summary([(r - announced[v]) * 1e3 for v, _, r in got
                                                     if measured.get(v) == src])
                                    for e, got in applied.items()} for src in sources},
              "applied_ms": {src: {str(e): summary([(t - announced[v]) * 1e3 for v, t, _ in got
                                                    if measured.get(v) == src])
                                   for e, got in applied.items()} for src in sources},
              "versions_applied": {str(e): len(got) for e, got in applied.items()}}
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    name = f"weight-sync-{args.model}-e{args.engines}-b{int(args.bucket_mb)}.json"
    (dest / name).write_text(json.dumps(record, indent=2))
    from benchmarks.harness import append_record
    config = {k: record[k] for k in ("model", "engines", "backend", "bucket_mb", "bytes", "tensors")}
    append_record("weight_sync", {k: v for k, v in record.items() if k not in config and k not in ("device", "date")},
                  config=config, card=record["device"] if gpu else None, gpu=gpu)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
