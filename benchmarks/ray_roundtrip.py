"""Message round trip controller -> engine -> controller: local process queues vs Ray actors.

Sends one ``Generate`` of a small chunk (one prompt, ``--tokens`` new tokens,
greedy) at a time to engine 0 and times until its ``Done`` is on the
outbox, ``--n`` times after ``--warmup``, for the local launcher's engine
process (``launch.placement=disaggregated``: multiprocessing queues and a
relay thread) and for the Ray launcher's engine actor (messages and answers
over its direct TCP channel, ``launch/ray_channel.py``). Prints the median and p90 of each; both
include the engine's own time for the chunk (the same engine and model).

    python benchmarks/ray_roundtrip.py [--address HOST:PORT] [--n 200] [--tokens 1]

Without ``--address`` Ray starts a local instance (``launch.ray_address`` empty).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script


def measure(launcher_cls, cfg, run_dir: Path, n: int, warmup: int, tokens: int) -> dict:
    from transformers import AutoTokenizer

    from conveyor.rollout.api import SamplingParams
    from conveyor.run.session import resolve_model_path
    from conveyor.transport.messages import Done, Failed, Generate
    path = resolve_model_path(cfg, run_dir)
    tok = AutoTokenizer.from_pretrained(path)
    launcher = launcher_cls(cfg, run_dir)
    engines = launcher.start_engines(path, tok)
    trainer = launcher.start_trainer(path, tok)
    trainer.publish(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)
    prompt = tok("12345=")["input_ids"]
    times = []
    try:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            engines.workers[0].send(Generate(i, [prompt], params, version=0))
            while True:
                msg = engines.outbox.get(timeout=60)
                if isinstance(msg, Failed):
                    raise SystemExit(f"engine {msg.engine_id} failed:\n{msg.traceback}")
                if isinstance(msg, Done):
                    break
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        trainer.close()
        launcher.stop_engines(engines.workers)
    times.sort()
    return {"median_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=1)
    args = ap.parse_args()
    from conveyor.config import load_config
    from conveyor.launch.local import LocalLauncher
    from conveyor.launch.ray import RayLauncher, connect
    base = ["sft.steps=0", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
            "model.tiny.intermediate_size=64", "launch.placement=disaggregated", "launch.weight_sync=broadcast",
            "launch.timeout_s=120", "loop.partial_rollouts=false"]
    with tempfile.TemporaryDirectory() as d:
        local = measure(LocalLauncher, load_config(None, base), Path(d) / "local", args.n, args.warmup, args.tokens)
        rcfg = load_config(None, [*base, "launch.backend=ray",
                                   *([f"launch.ray_address={args.address}"] if args.address else [])])
        connect(rcfg)
        made: list = []

        def ray_launcher(cfg, run_dir):
            made.append(RayLauncher(cfg, run_dir))
            return made[-1]
        try:
            remote = measure(ray_launcher, rcfg, Path(d) / "ray", args.n, args.warmup, args.tokens)
        finally:
            for la in made:
                la.close()
    print(f"Generate -> Done, 1 prompt, {args.tokens} new token(s), n={args.n}:")
    print(f"  local process queues: median {local['median_ms']:.2f} ms, p90 {local['p90_ms']:.2f} ms")
    print(f"  Ray engine actor:     median {remote['median_ms']:.2f} ms, p90 {remote['p90_ms']:.2f} ms")
    from benchmarks.harness import append_record
    out = append_record("ray_roundtrip", {"local_median_ms": local["median_ms"], "local_p90_ms": local["p90_ms"],
                                          "ray_median_ms": remote["median_ms"], "ray_p90_ms": remote["p90_ms"]},
                        config={"n": args.n, "tokens": args.tokens, "address": args.address or "local"}, gpu=False)
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
