"""The native engine's host work per decode step, without the model: what a GPU step must hide.

The paged loop queues a decode step before it reads the one before, so the host's work
(scheduling, block tables, the next step's inputs, sampling seeds, reading tokens back,
stop rules) runs while the GPU computes. When the host takes longer than the GPU's step,
the engine is bound by the host. This benchmark runs the real loop and runner on the CPU
with the decoder's forward replaced by a preset logits tensor and the sampler by preset
tokens (no EOS, so every sequence runs to its budget), and reports host milliseconds per
decode step at each batch size (the best of ``--reps`` calls; one summary record per batch
in ``results/engine_host_cpu.jsonl``). Compare it with the decode graph's time on a GPU
(``benchmarks/engine_gpu.py`` prints ``graph_ms``): at 0.5B on an H200 1.04 ms at 64 rows
and 1.52 ms at 256. Not counted here: the CUDA calls of a step (input copies, the graph
launch, the sampler kernel, the copy back, an event), which a GPU host adds.

    python benchmarks/engine_host.py [--batches 64,256] [--new 256] [--reps 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

from benchmarks.harness import append_record
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.native import paged_loop


def engine(max_batch: int) -> NativeEngine:
    from conveyor.data.tiny import build_model, build_tokenizer
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                        max_position_embeddings=1024)
    eng = NativeEngine(model, tok, device="cpu", dtype="float32", runner="fast", max_batch=max_batch,
                       kv_blocks=max_batch * 1024 // 16 + 64)
    runner = eng.runner
    logits = torch.zeros(max_batch, runner.net.vocab)
    runner._decode_forward = lambda size, max_ctx: logits[:size]  # the GPU's part: a graph replay
    return eng


def preset_sampler(vocab: int, eos: set[int]):
    token = next(t for t in range(5, vocab) if t not in eos)

    def fused(logits, *, temperature, eos_ids, eos_bias, seeds=None):
        n = logits.shape[0]
        return torch.full((n,), token, dtype=torch.long), torch.zeros(n)
    return fused


def host_ms_per_step(eng: NativeEngine, batch: int, new: int, reps: int) -> float:
    prompts = [[7 + i % 50] * 32 for i in range(batch // 8)]
    params = SamplingParams(temperature=1.0, n=8, max_new_tokens=new, seed=0)
    best = float("inf")
    for _ in range(reps + 1):  # the first call warms up
        steps0 = eng.counters["decode_steps"]
        start = time.perf_counter()
        eng.generate(prompts, params)
        seconds = time.perf_counter() - start
        best = min(best, seconds / max(1, eng.counters["decode_steps"] - steps0))
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    eng = engine(max(batches))
    original = paged_loop.PagedLoop.__init__

    def init(self, *a, **kw):
        original(self, *a, **kw)
        self.fused = preset_sampler(eng.runner.net.vocab, set(eng.eos_ids))
    paged_loop.PagedLoop.__init__ = init
    for b in batches:
        ms = host_ms_per_step(eng, b, args.new, args.reps)
        print(f"batch {b}: {ms:.3f} ms of host work per decode step", flush=True)
        append_record("engine_host", {"host_ms_per_step": ms}, config={"batch": b, "new_tokens": args.new},
                      gpu=False)


if __name__ == "__main__":
    main()
