"""Decode throughput of the native engine on CPU with the default tiny model.

Prints completion tokens per second for one batch (default 64 sequences, prompts
of 16 random ids, 128 new tokens, EOS masked out by a negative ``eos_bias`` so every
sequence runs to full length). This is a smoke measurement of per-step overhead,
not a protocol number: BENCHMARKS.md reports absolute times only from a GPU.

    python benchmarks/engine_cpu.py [--batch 64] [--new 128] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = build_tokenizer()
    engine = NativeEngine(build_model(tok), tok, device="cpu", dtype="float32", max_batch=args.batch)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, len(tok), (args.batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, eos_bias=-1e4, seed=0)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for g in out for c in g)
    print(f"native engine, CPU ({torch.get_num_threads()} threads), tiny Llama hidden 128 x 4 layers")
    from benchmarks.harness import append_record
    append_record("engine", {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                             "threads": torch.get_num_threads()},
                  config={"model": "tiny", "batch": args.batch, "prompt_len": args.prompt_len, "new": args.new},
                  gpu=False)
    print(f"batch {args.batch}, prompt {args.prompt_len}, new {args.new}: {tokens} tokens in {seconds:.2f} s "
          f"= {tokens / seconds:,.0f} tokens/s ({seconds / args.new * 1e3:.1f} ms per step incl. prefill)")


if __name__ == "__main__":
    main()
