"""What the environment pool's overlap buys: episodes/s with a slow environment, concurrency 1 vs 16.

Episodes of 2 turns with the tiny model on the native engine (an engine worker
thread, as in a run); every environment step waits 100 ms (a slow tool: the
wait is `time.sleep` in a plain method, so it runs in the pool's threads).
At concurrency c, c episodes are in flight and their turns share the engine's
batch. Target: concurrency 16 at least 8x concurrency 1 (the waits overlap;
the engine is not the limit at these sizes). Appends one record to
benchmarks/results/ (workload ``env_pool``).

    python benchmarks/env_pool.py [--episodes 64] [--sleep 0.1]
"""
from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

from benchmarks.harness import append_record  # noqa: E402
from conveyor.data.tiny import build_model, build_tokenizer  # noqa: E402
from conveyor.env.api import StepResult  # noqa: E402
from conveyor.env.pool import EnvPool, PoolLimits  # noqa: E402
from conveyor.episodes.multi_turn import EpisodeLimits, TurnFormat  # noqa: E402
from conveyor.episodes.runner import EpisodeRunner  # noqa: E402
from conveyor.launch.roles import ThreadWorker  # noqa: E402
from conveyor.rollout.api import SamplingParams  # noqa: E402
from conveyor.rollout.native import NativeEngine  # noqa: E402
from conveyor.rollout.serve import engine_loop  # noqa: E402
from conveyor.transport.messages import Done, Stop  # noqa: E402
from conveyor.transport.weights import StagedWeights  # noqa: E402
from conveyor.types import Task  # noqa: E402


class SlowEnv:
    def __init__(self, sleep_s: float, turns: int = 2):
        self.sleep_s, self.turns, self.n = sleep_s, turns, 0

    def reset(self, task):
        self.n = 0
        return task.prompt

    def step(self, action):
        time.sleep(self.sleep_s)  # a tool that takes its time
        self.n += 1
        return StepResult("ok", 1.0 if self.n >= self.turns else 0.0, self.n >= self.turns)


def episodes_per_s(concurrency: int, episodes: int, sleep_s: float, tok, model) -> float:
    engine = NativeEngine(model, tok, device="cpu", dtype="float32", runner="fast", kv_blocks=512, max_batch=32)
    specs = [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]
    inbox, outbox = queue.Queue(), queue.Queue()
    t = threading.Thread(target=engine_loop, args=(engine, inbox, outbox, StagedWeights(specs), 0, True, 60.0),
                         daemon=True)
    t.start()
    pool = EnvPool(lambda: SlowEnv(sleep_s), PoolLimits(concurrency=concurrency, step_timeout_s=30))
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=1)
    runner = EpisodeRunner([ThreadWorker(0, inbox, t)], pool, TurnFormat(tok, chat=False), EpisodeLimits(2, 64, 16, 256),
                           sampling=lambda seed: SamplingParams(**{**params.__dict__, "seed": seed}), n=1,
                           version=lambda: 0, timeout_s=60)
    stop = threading.Event()

    def pump():
        while not stop.is_set():
            try:
                msg = outbox.get(timeout=0.005)
            except queue.Empty:
                continue
            if isinstance(msg, Done):
                runner.answer(msg)
    threading.Thread(target=pump, daemon=True).start()
    t0 = time.perf_counter()
    out = runner.run_tasks([Task(f"e{i}", "go:") for i in range(episodes)], params.__class__(
        **{**params.__dict__, "seed": 0}), timeout_s=600)
    elapsed = time.perf_counter() - t0
    assert all(o is not None for o in out)
    runner.close()
    inbox.put(Stop())
    t.join(10)
    stop.set()
    return episodes / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--sleep", type=float, default=0.1)
    args = ap.parse_args()
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384).eval()
    one = episodes_per_s(1, max(8, args.episodes // 8), args.sleep, tok, model)
    many = episodes_per_s(16, args.episodes, args.sleep, tok, model)
    metrics = {"episodes_per_s_c1": one, "episodes_per_s_c16": many, "speedup": many / one,
               "sleep_s": args.sleep, "turns": 2}
    print(f"episodes/s: concurrency 1 {one:.2f}, concurrency 16 {many:.2f}: {many / one:.1f}x "
          f"(environment step {args.sleep * 1e3:.0f} ms, 2 turns)")
    print("appended to", append_record("env_pool", metrics, config=vars(args), gpu=False))


if __name__ == "__main__":
    main()
