"""8-bit rollouts (``rollout.quantization``): decode speed and engine-vs-trainer mismatch, bf16 vs fp8 vs int8.

For each quantization the native engine's fast runner (bf16 engine dtype, CUDA graphs on a GPU)
is built on the same randomly initialised model and measured twice:
- decode: completion tokens/s at each ``--batches`` size (``--group`` samples per prompt, prompts
  of ``--prompt-len`` random ids, ``--new`` tokens each with EOS masked by a large negative
  ``eos_bias``), end to end and for decode alone (prefill, timed with synchronisation,
  subtracted), beside the memory-bandwidth bound of a step
      step time >= (weight bytes read + B x L x KV bytes per token) / bandwidth
  where the weight bytes are what a decode step reads (8-bit linear weights and their scales,
  the rest in bf16) and L is the mean context (benchmarks/engine_gpu.py's bound);
- mismatch: completions of ``--mismatch-prompts`` prompts sampled at temperature 1 are scored by
  the trainer's view of the same weights (float32 master weights; bf16 autocast on a GPU, the
  single-device trainer's default; float32 on a CPU). Per token d = trainer - engine logprob:
  max and mean |d|, the KL estimates k1 = mean(-d) and k3 = mean(exp(d) - 1 - d) of
  KL(engine || trainer), and the importance ratio exp(d): p1 / p50 / p99 and the share outside
  [0.8, 1.2] (PPO's clip range), which ``algo.importance_sampling=truncated`` corrects.
Also: engine setup seconds and the pause of one full weight update (copy plus re-quantisation).

One JSON per quantization goes to ``--out``, a markdown table is printed last, and one summary
line per quantization is appended to benchmarks/results/quantized_rollout{,_cpu}.jsonl.

    python benchmarks/quantized_rollout.py --shape tiny --out runs/quant-cpu          # CPU smoke
    python benchmarks/quantized_rollout.py --shape 0.5b --out runs/quant-gpu          # W1's 0.5B, one GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

from benchmarks.engine_gpu import CONFIGS, EOS, VOCAB, bandwidth
from benchmarks.harness import append_record
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.native.quant import QuantWeight

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "tie_word_embeddings": True}
TINY_VOCAB = 512
DEFAULTS = {"tiny": {"batches": "8,16", "prompt_len": 16, "new": 16, "group": 4, "mismatch_prompts": 4},
            "0.5b": {"batches": "64,256", "prompt_len": 128, "new": 256, "group": 8, "mismatch_prompts": 16}}


def build(shape: str, device: torch.device):
    """The float32 model (the trainer's master weights), seeded: every quantization sees the same."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    vocab = TINY_VOCAB if shape == "tiny" else VOCAB
    eos = vocab - 1 if shape == "tiny" else EOS
    dims = TINY if shape == "tiny" else CONFIGS[shape]
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=4096, eos_token_id=eos, bos_token_id=eos,
                      attn_implementation="sdpa", **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def read_bytes(engine) -> int:
    """Bytes of weights a decode step reads: 8-bit linear weights and scales, the rest as stored."""
    net, seen, total = engine.runner.net, set(), 0
    tensors = [net.final_norm, net.lm_head] + ([net.lm_bias] if net.lm_bias is not None else [])
    for layer in net.layers:
        for w in (layer.qkv_w, layer.o_w, layer.gu_w, layer.down_w):
            tensors += [w.q, w.scale] if isinstance(w, QuantWeight) else [w]
        tensors += [t for t in (layer.in_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                                layer.qkv_b, layer.o_b, layer.gu_b, layer.down_b) if t is not None]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def decode_speed(engine, device, batch: int, args, gen: torch.Generator, vocab: int) -> dict:
    n = min(args.group, batch)
    prompts = torch.randint(10, vocab - 10, (batch // n, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, n=n, max_new_tokens=args.new, eos_bias=-1e9, seed=0)
    engine.generate(prompts[:2], SamplingParams(n=n, max_new_tokens=4, eos_bias=-1e9, seed=0))  # warm-up
    prefill_s, real = [0.0], engine.runner.prefill

    def prefill(reqs):
        _sync(device)
        t = time.perf_counter()
        out = real(reqs)
        _sync(device)
        prefill_s[0] += time.perf_counter() - t
        return out

    engine.runner.prefill = prefill
    _sync(device)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    _sync(device)
    total = time.perf_counter() - start
    engine.runner.prefill = real
    tokens = sum(len(c.token_ids) for g in out for c in g)
    return {"batch": batch, "tokens": tokens, "seconds": total, "prefill_seconds": prefill_s[0],
            "tok_s": tokens / total, "decode_tok_s": tokens / max(total - prefill_s[0], 1e-9)}


def trainer_logprobs(model, prompt: list[int], completion: list[int], device) -> torch.Tensor:
    ids = torch.tensor([prompt + completion], device=device)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, torch.tensor(completion, device=device)[:, None]).squeeze(-1).cpu()


def mismatch(engine, model, device, args, gen: torch.Generator, vocab: int) -> dict:
    prompts = torch.randint(10, vocab - 10, (args.mismatch_prompts, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=args.new, eos_bias=-1e9, seed=1)
    diffs = []
    for prompt, samples in zip(prompts, engine.generate(prompts, params)):
        for c in samples:
            diffs.append(trainer_logprobs(model, prompt, c.token_ids, device) - torch.tensor(c.logprobs))
    d = torch.cat(diffs).double()
    ratio = d.exp()
    q = torch.quantile(ratio, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64))
    return {"tokens": int(d.numel()), "max_abs_logprob_diff": float(d.abs().max()),
            "mean_abs_logprob_diff": float(d.abs().mean()), "kl_k1": float((-d).mean()),
            "kl_k3": float((ratio - 1 - d).mean()), "ratio_p1": float(q[0]), "ratio_p50": float(q[1]),
            "ratio_p99": float(q[2]), "ratio_outside_0.8_1.2": float(((ratio < 0.8) | (ratio > 1.2)).double().mean())}


def update_pause_ms(engine, model, device) -> float:
    """One full weight update from bf16 copies of the masters: the copy plus re-quantisation."""
    named = [(k, v.detach().to(torch.bfloat16)) for k, v in model.named_parameters()]
    _sync(device)
    start = time.perf_counter()
    engine.update_weights(named, version=engine.version + 1)
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def run_one(quantization: str, model, device, args, card: str) -> dict:
    import copy

    vocab, cfg = model.config.vocab_size, model.config
    start = time.perf_counter()
    engine = NativeEngine(copy.deepcopy(model), None, device=device, dtype="bfloat16", runner="fast",
                          max_batch=max(args.batches), quantization=quantization,
                          kv_blocks=None if device.type == "cuda" else 4096)
    row = {"quantization": quantization, "shape": args.shape, "engine": engine.label,
           "setup_s": time.perf_counter() - start, "weight_read_bytes": read_bytes(engine),
           "gemm": sorted({qw.method for qw in engine.runner.net.quant_weights}) or ["bf16"],
           "cuda_graphs": engine.runner.use_graphs}
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    gen = torch.Generator().manual_seed(1)
    row["decode"] = []
    for batch in args.batches:
        speed = decode_speed(engine, device, batch, args, gen, vocab)
        if device.type == "cuda":
            step = (row["weight_read_bytes"] + batch * (args.prompt_len + args.new / 2) * kv_per_token) / bandwidth(card)
            speed["bound_tok_s"] = batch / step
            speed["mbu"] = speed["decode_tok_s"] / speed["bound_tok_s"]
        row["decode"].append(speed)
        print(f"{quantization} batch {batch}: {json.dumps(speed)}", flush=True)
    row["mismatch"] = mismatch(engine, model, device, args, gen, vocab)
    row["update_pause_ms"] = update_pause_ms(engine, model, device)
    print(f"{quantization}: mismatch {json.dumps(row['mismatch'])}, update pause {row['update_pause_ms']:.1f} ms",
          flush=True)
    engine.close()
    return row


def table(rows: list[dict], card: str) -> str:
    lines = [f"card: {card}", "",
             ("| quantization | batch | decode tok/s | vs bf16 | bound tok/s | max abs logprob diff | k3 KL "
              "| ratio p1 / p50 / p99 | update pause ms |"), "|---|---|---|---|---|---|---|---|---|"]
    base = {d["batch"]: d["decode_tok_s"] for r in rows if r["quantization"] == "none" for d in r["decode"]}
    for r in rows:
        m = r["mismatch"]
        for d in r["decode"]:
            rel = f"{d['decode_tok_s'] / base[d['batch']]:.2f}x" if d["batch"] in base else ""
            bound = f"{d['bound_tok_s']:,.0f}" if "bound_tok_s" in d else ""
            lines.append(f"| {r['quantization']} | {d['batch']} | {d['decode_tok_s']:,.0f} | {rel} | {bound} | "
                         f"{m['max_abs_logprob_diff']:.4f} | {m['kl_k3']:.2e} | {m['ratio_p1']:.3f} / "
                         f"{m['ratio_p50']:.3f} / {m['ratio_p99']:.3f} | {r['update_pause_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("tiny", "0.5b", "1.5b"), default="tiny")
    ap.add_argument("--device", default="auto", help="auto: cuda when available")
    ap.add_argument("--quantizations", default="none,fp8,int8")
    ap.add_argument("--batches", default=None, help="decode batch sizes (tiny: 8,16; GPU shapes: 64,256)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new", type=int, default=None, help="tokens per completion")
    ap.add_argument("--group", type=int, default=None, help="samples per prompt")
    ap.add_argument("--mismatch-prompts", type=int, default=None, help="prompts (x4 samples) scored by the trainer")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (a shared CPU keeps timings sane at 1)")
    ap.add_argument("--out", default="runs/quantized-rollout")
    args = ap.parse_args()
    for key, value in DEFAULTS["tiny" if args.shape == "tiny" else "0.5b"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.set_num_threads(args.threads)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    model = build(args.shape, device)
    print(f"card: {card}, torch {torch.__version__}, shape {args.shape}", flush=True)
    rows = []
    for quantization in args.quantizations.split(","):
        row = run_one(quantization, model, device, args, card)
        rows.append(row)
        with open(os.path.join(args.out, f"quantized_rollout_{args.shape}_{quantization}.json"), "w") as f:
            json.dump(row, f, indent=1)
        config = {"shape": args.shape, "quantization": quantization, "batches": args.batches, "group": args.group,
                  "prompt_len": args.prompt_len, "new_tokens": args.new, "engine_dtype": "bfloat16"}
        metrics = {"decode": row["decode"], "mismatch": row["mismatch"], "setup_s": row["setup_s"], "gemm": row["gemm"],
                   "update_pause_ms": row["update_pause_ms"], "weight_read_bytes": row["weight_read_bytes"]}
        append_record("quantized_rollout", metrics, config=config,
                      card=card if device.type == "cuda" else None, gpu=device.type == "cuda")
    md = table(rows, card)
    with open(os.path.join(args.out, "quantized_rollout.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
