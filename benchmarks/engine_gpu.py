"""Decode throughput of the native engine's fast runner on one GPU, beside Hugging Face ``generate``.

Workload (BENCHMARKS.md W1 shapes): randomly initialised Qwen2.5-0.5B and 1.5B
configurations in bf16, prompts of 128 random ids, groups of 8 samples per
prompt, a fixed number of new tokens per sample (EOS masked out with a large
negative ``eos_bias``), batch 64 / 256 / 1024 sequences. For each point it
reports completion tokens/s end to end (prefill included) and for decode alone
(prefill time, measured with synchronisation, subtracted), and the memory
bandwidth utilisation against the bound

    step time >= (weight bytes + B x L x KV bytes per token) / bandwidth

with L the mean context over the run (prompt + new / 2) and the card's
datasheet bandwidth (3.35 TB/s H100, 4.8 TB/s H200), and against the roofline,
where the weights' GEMMs take the longer of their bytes and their FLOPs (2 per
weight per row at 800 TFLOP/s): from about 170 rows on an H200 a decode step's
GEMMs are bound by arithmetic, not bytes. A breakdown times one
decode graph replay and one sampling call (reference and fused) at each batch
size, so the host's share of a step is the rest; ``--profile-batch`` prints the
top GPU kernels of the decode forward for the first model; ``--tune-attn`` times
the decode-attention tiles and splits on heavy-tailed contexts first and keeps the
fastest for the run. HF ``generate`` runs at batch 64 on the same
model object (its parameters share storage with the fast runner's fused
weights). A parity check compares the fast runner's first-token logprobs with a
plain HF forward in bf16.

One JSON per configuration is written to ``--out`` and a markdown table is
printed last.

    PYTHONPATH=src python benchmarks/engine_gpu.py --out runs/engine-gpu [--models 0.5b,1.5b] [--batches 64,256,1024]
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

from benchmarks.harness import append_record
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.native.sampling import sample

CONFIGS = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, tie_word_embeddings=True),
}
VOCAB, EOS = 151936, 151643
PEAK_FLOPS = 800e12  # bf16 matrix products on an H100 / H200 (BENCHMARKS.md)


def bandwidth(name: str) -> float:
    return 4.8e12 if "H200" in name else 3.35e12


def build(size: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=32768, eos_token_id=EOS, bos_token_id=EOS,
                      attn_implementation="sdpa", **CONFIGS[size])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def parity(engine, model, prompts) -> dict:
    """First-token logprob of the fast runner against a plain HF forward (bf16, same weights)."""
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=1))
    with torch.inference_mode():
        logits = model(torch.tensor(prompts, device="cuda")).logits[:, -1].float()
    ref = torch.log_softmax(logits, -1)
    toks = torch.tensor([g[0].token_ids[0] for g in out], device="cuda")
    diff = (ref.gather(-1, toks[:, None]).squeeze(-1).cpu() - torch.tensor([g[0].logprobs[0] for g in out])).abs()
    return {"max_abs_logprob_diff": float(diff.max()), "argmax_agree": float((ref.argmax(-1) == toks).float().mean())}


def timed_generate(engine, prompts, params) -> tuple[list, float, float]:
    prefill_s = [0.0]
    real = engine.runner.prefill

    def prefill(reqs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = real(reqs)
        torch.cuda.synchronize()
        prefill_s[0] += time.perf_counter() - t
        return out

    engine.runner.prefill = prefill
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    engine.runner.prefill = real
    return out, total, prefill_s[0]


def breakdown(engine, batch: int) -> dict:
    """GPU time of one decode graph replay and one sampling call at this batch size (ms)."""
    graph = engine.runner._graphs.get(engine.runner._bucket(batch))
    res = {}
    if graph is not None:
        res["graph_ms"] = _time_ms(graph[0].replay)
    logits = torch.randn(batch, VOCAB, device="cuda", dtype=torch.bfloat16)
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64)  # one random stream per row
    res["sample_ms"] = _time_ms(lambda: sample(logits, temperature=1.0, eos_ids=(EOS,), eos_bias=-1e9, seeds=seeds))
    fused = getattr(engine.runner.ops, "sample_plain", None)
    if fused is not None:
        eos = torch.tensor([EOS], device="cuda")
        res["fused_sample_ms"] = _time_ms(lambda: fused(logits, temperature=1.0, eos_ids=eos, eos_bias=-1e9,
                                                        seeds=seeds))
        res["fused_greedy_ms"] = _time_ms(lambda: fused(logits, temperature=0.0, eos_ids=eos, eos_bias=-1e9))
    return res


def _graph_ms(fn, reps: int = 8) -> float:
    """GPU time of one ``fn`` call, from a CUDA graph of ``reps`` calls (no host launch cost)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return _time_ms(graph.replay, reps=5) / reps


def tune_attention() -> None:
    """Time decode-attention settings per head dim and keep the fastest for this run: the tile
    (tokens, warps, pipeline stages) and the split of a context into lanes of fixed chunks
    (``attention_split``; its small-batch and large-batch settings are tuned separately).

    Context lengths are heavy-tailed as in an RL step (129 + exponential with mean 256, at most
    1152): a kernel that gives each sequence one program spends the time of the longest one.
    Each timed call reads one of four disjoint block sets in turn, so the KV comes from memory
    rather than from the L2 cache, as in a real step.
    """
    from conveyor.rollout.native.kernels import torch_ops as fast_ops, triton_ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [(16, 14, 2, 64), (64, 14, 2, 64), (256, 14, 2, 64), (64, 12, 2, 128), (256, 12, 2, 128)]
    data = {}
    for b, nq, nkv, d in cases:
        nb = 4 * b * 72 + 1
        kc, vc = (torch.randn(nb * 16, nkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        tables = (torch.randperm(nb - 1, device="cuda") + 1).view(4, b, 72).to(torch.int32)
        lens = (torch.empty(b, device="cuda").exponential_(1 / 256, generator=gen) + 129).clamp(max=1152).long()
        data[(b, nq, nkv, d)] = (torch.randn(b, nq, d, device="cuda", dtype=torch.bfloat16), kc, vc, tables, lens)
    tiles = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 3)]
    splits = [(lanes, chunk) for lanes in (4, 8, 16) for chunk in (64, 128, 256)]
    small = lambda case: triton_ops.small_batch(case[0], case[2], torch.device("cuda"))  # noqa: E731
    saved = triton_ops.attention_split
    for d in sorted({c[3] for c in cases}):
        for is_small in (True, False):
            group = [c for c in cases if c[3] == d and small(c) == is_small]
            if not group:
                continue
            best = None
            for (block_n, warps, stages), split in [(t, sp) for t in tiles for sp in splits if t[0] <= sp[1]]:
                triton_ops.ATTN_CONFIG[d] = (block_n, warps, stages)
                triton_ops.attention_split = lambda *_, sp=split: sp
                times = []
                try:
                    for case in group:
                        q, kc, vc, tables, lens = data[case]
                        out = triton_ops.decode_attention(q, kc, vc, tables[0], lens, 0.125, 16)
                        ref = fast_ops.decode_attention(q, kc, vc, tables[0], lens, 0.125, 16, int(lens.max()))
                        err = (out.float() - ref.float()).abs().max().item()
                        if err > 3e-2:
                            raise AssertionError(f"decode attention {case} {block_n}/{warps}/{stages} {split}: "
                                                 f"error {err}")
                        turn = iter(range(1 << 30))
                        times.append((case, _graph_ms(lambda: triton_ops.decode_attention(
                            q, kc, vc, tables[next(turn) % 4], lens, 0.125, 16))))
                except AssertionError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a tile too large for shared memory: skip it
                    print(f"attn tune: D{d} tile {block_n} warps {warps} stages {stages}: {type(exc).__name__}")
                    continue
                total = sum(t for _, t in times)
                if best is None or total < best[0]:
                    best = (total, (block_n, warps, stages), split, times)
            _, tile, split, times = best
            print(f"attn tune: D{d} {'small' if is_small else 'large'} batches: tile/warps/stages {tile}, "
                  f"lanes x chunk {split}: " + " ".join(f"B{c[0]}={t * 1e3:.1f}us" for c, t in times), flush=True)
            if is_small:
                triton_ops.SMALL_BATCH_SPLIT = split
            else:
                triton_ops.LARGE_BATCH_SPLIT = split
                triton_ops.ATTN_CONFIG[d] = tile  # one tile per head dim: the large batches' choice
    triton_ops.attention_split = saved


def profile(engine, batch: int) -> None:
    """Top GPU kernels of three eager decode forwards at this batch size (the graph runs the same kernels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner = engine.runner
    size = runner._bucket(batch)
    with torch.inference_mode():
        runner._decode_forward(size, 1)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner._decode_forward(size, 1)
            torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_cuda_time_total", "self_device_time_total"):
        try:
            print(averages.table(sort_by=key, row_limit=18), flush=True)
            return
        except (AttributeError, KeyError, ValueError):
            continue


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def hf_generate(model, batch: int, prompt_len: int, new: int) -> dict:
    ids = torch.randint(1000, VOCAB - 1000, (batch, prompt_len), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new, min_new_tokens=new,
              pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :16], **{**kw, "attention_mask": torch.ones_like(ids[:, :16]), "max_new_tokens": 4,
                                       "min_new_tokens": 4})
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    tokens = (out.shape[1] - prompt_len) * batch
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def hf_continuous(model, batch: int, prompt_len: int, new: int) -> dict:
    """transformers' own continuous batching (``generate_batch``), same model object and shapes.
    Any failure is recorded, not raised: it is a peer, not the system under test."""
    from transformers import GenerationConfig
    try:
        prompts = torch.randint(1000, VOCAB - 1000, (batch, prompt_len)).tolist()
        cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True, eos_token_id=None,
                               pad_token_id=0)
        # No inference_mode here: generate_batch's worker resets its static tensors in place.
        model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=True, eos_token_id=None, pad_token_id=0))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=cfg)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(o.generated_tokens) for o in out.values())
        if tokens == 0:  # the manager swallowed a failure; report what came back
            first = next(iter(out.values()), None)
            return {"error": f"no tokens from {len(out)} requests; first: {str(first)[:300]}"}
        return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def run_model(size: str, args, card: str) -> list[dict]:
    model = build(size)
    wbytes = weight_bytes(model)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    t = time.perf_counter()
    engine = NativeEngine(model, None, device="cuda", dtype="bfloat16", max_batch=max(args.batches))
    setup_s = time.perf_counter() - t
    gen = torch.Generator().manual_seed(1)
    check = parity(engine, model, torch.randint(1000, VOCAB - 1000, (8, args.prompt_len), generator=gen).tolist())
    print(f"{size}: engine setup {setup_s:.1f} s (pool {engine.runner.allocator.capacity} blocks), parity {check}",
          flush=True)
    rows = []
    for batch in args.batches:
        n = min(args.group, batch)
        prompts = torch.randint(1000, VOCAB - 1000, (batch // n, args.prompt_len), generator=gen).tolist()
        params = SamplingParams(temperature=1.0, n=n, max_new_tokens=args.new, eos_bias=-1e9, seed=0)
        # Warm-up with the timed call's parameters: they pick the sampler kernel's specialisation.
        engine.generate(prompts[:2], SamplingParams(n=n, max_new_tokens=4, eos_bias=-1e9, seed=0))
        out, total, prefill = timed_generate(engine, prompts, params)
        tokens = sum(len(c.token_ids) for g in out for c in g)
        ctx = args.prompt_len + args.new / 2
        kv_step = batch * ctx * kv_per_token / bandwidth(card)
        bound_step = wbytes / bandwidth(card) + kv_step
        # The roofline: the weights' GEMMs take at least their bytes or their FLOPs (2 per weight per
        # row, at the matrix rate BENCHMARKS.md uses), whichever is longer; attention reads its KV.
        roofline_step = max(wbytes / bandwidth(card), 2 * (wbytes / 2) * batch / PEAK_FLOPS) + kv_step
        decode_tok_s = tokens / max(total - prefill, 1e-9)
        row = {"card": card, "model": f"qwen2.5-{size}-config", "dtype": "bfloat16", "batch": batch, "group": n,
               "prompt_len": args.prompt_len, "new_tokens": args.new, "tokens": tokens, "seconds": total,
               "prefill_seconds": prefill, "tok_s": tokens / total, "decode_tok_s": decode_tok_s,
               "bound_tok_s": batch / bound_step, "mbu": decode_tok_s / (batch / bound_step),
               "roofline_tok_s": batch / roofline_step, "of_roofline": decode_tok_s * roofline_step / batch,
               "weight_bytes": wbytes, "kv_bytes_per_token": kv_per_token, "parity": check,
               "breakdown": breakdown(engine, batch)}
        if batch == args.profile_batch and size == args.models.split(",")[0]:
            profile(engine, batch)
        if batch == args.hf_batch and args.hf_new > 0:
            row["hf_generate"] = hf_generate(model, batch, args.prompt_len, args.hf_new)
            row["hf_continuous_batching"] = hf_continuous(model, batch, args.prompt_len, args.hf_new)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, f"engine_gpu_{size}_b{batch}.json"), "w") as f:
            json.dump(row, f, indent=1)
        config = {k: row[k] for k in ("model", "batch", "group", "prompt_len", "new", "dtype") if k in row}
        metrics = {k: v for k, v in row.items() if k not in config and k not in ("card", "breakdown")}
        metrics.update({k: v for k, v in row["breakdown"].items() if isinstance(v, (int, float))})
        append_record("engine", metrics, config=config, card=card, gpu=True)
    engine.close()
    del model
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | tok/s (e2e) | decode tok/s | bound tok/s | MBU | roofline tok/s | of roofline "
             "| graph ms | sample ms (ref / fused) | HF generate tok/s | HF continuous batching tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["breakdown"]
        hf = r.get("hf_generate", {}).get("tok_s")
        cb = r.get("hf_continuous_batching", {})
        cb_cell = f"{cb['tok_s']:,.0f}" if "tok_s" in cb else cb.get("error", "")[:60]
        lines.append(f"| {r['model']} | {r['batch']} | {r['tok_s']:,.0f} | "
                     f"{r['decode_tok_s']:,.0f} | {r['bound_tok_s']:,.0f} | {r['mbu']:.1%} | "
                     f"{r['roofline_tok_s']:,.0f} | {r['of_roofline']:.1%} | {b.get('graph_ms', float('nan')):.2f} | "
                     f"{b['sample_ms']:.2f} / {b.get('fused_sample_ms', float('nan')):.2f} | "
                     f"{'' if hf is None else f'{hf:,.0f}'} | {cb_cell} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/engine-gpu", help="per-configuration JSON and the table")
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hf-new", type=int, default=64)
    ap.add_argument("--tune-attn", action="store_true", help="time decode-attention launch settings first")
    ap.add_argument("--profile-batch", type=int, default=256, help="kernel profile of the first model (0 = off)")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    card = torch.cuda.get_device_name()
    print(f"card: {card}, torch {torch.__version__}", flush=True)
    if args.tune_attn:
        tune_attention()
    rows = []
    for size in args.models.split(","):
        rows += run_model(size, args, card)
    md = f"card: {card}\n\n" + table(rows)
    with open(os.path.join(args.out, "engine_gpu.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
