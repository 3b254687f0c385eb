"""Trainer throughput on W1's batch shape: tokens/s and MFU of one RL step, 1 or N ranks.

    python benchmarks/trainer_gpu.py --model qwen2.5-0.5b --ranks 1 --out runs/trainer   # LocalTrainer
    python benchmarks/trainer_gpu.py --model qwen2.5-0.5b --ranks 2 --out runs/trainer   # FSDP2, 2 GPUs
    python benchmarks/trainer_gpu.py --model tiny --ranks 2 --steps 2 --out runs/t-cpu   # CPU smoke (gloo)

Contract: builds W1's random-init model (``models.build_w1_model``), one
batch of ``--prompts x --group`` sequences (``--prompt-len`` prompt tokens
plus a completion drawn from W1's heavy-tailed length law: geometric with
mean ``--target-mean``, capped at ``--max-new-tokens``), and times
``--steps`` ``train()`` calls with W1's loss (token-mean PPO-clip) after one
warm-up call. ``--ranks 1`` times ``LocalTrainer``; more ranks spawn that
many processes (one GPU each) running ``FSDPTrainer`` together. Writes
``<out>/trainer-<model>-r<ranks>.json`` with seconds per step, trained
tokens/s, MFU against the card's dense bf16 peak (6 * params FLOP per
token, attention excluded) and peak memory; ``--profile`` adds the top
CUDA kernels of one step; ``--vary K`` then times K steps on a
new batch each (the loop's situation: new micro-batch shapes every step);
``--gather`` (ranks > 1) times a full-weight
gather in bf16 (what a publish costs before any transport), one all-gather
per tensor against 256 MiB buckets.

It measures the trainer alone: no engine, no weight sync.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _batch(args, vocab: int, seed: int = 0):
    import torch

    from conveyor.types import Batch
    gen = torch.Generator().manual_seed(seed)
    p = 1.0 / args.target_mean
    ids, masks, lens = [], [], []
    for _ in range(args.prompts * args.group):
        u = float(torch.rand((), generator=gen))
        n = min(args.max_new_tokens, 1 + int(torch.log(torch.tensor(1 - u)) / torch.log(torch.tensor(1 - p))))
        ids.append(torch.randint(100, vocab, (args.prompt_len + n,), generator=gen))
        masks.append(torch.cat([torch.zeros(args.prompt_len), torch.ones(n)]))
        lens.append(n)
    fields = {"advantages": [torch.randn(()).expand(len(x)).clone() * m for x, m in zip(ids, masks)],
              "behaviour_logprobs": [-torch.rand(len(x), generator=gen) * m for x, m in zip(ids, masks)]}
    return Batch(input_ids=ids, loss_mask=masks, fields=fields), lens


def _trainer(args, path: str, rank: int, world: int):
    from conveyor.config import TrainerConfig
    over = {"micro_batch_tokens": args.micro_batch_tokens, "gradient_checkpointing": args.checkpointing,
            "lr": 1e-6, "compile": args.compile, "logprob_chunk_rows": args.logprob_chunk_rows or None,
            "pad_multiple": args.pad_multiple, "attention_mask": args.attention_mask,
            "param_dtype": args.param_dtype, "kernels": not args.no_kernel, "fsdp_reshard": args.fsdp_reshard,
            "pack_sequences": args.pack}
    cfg = TrainerConfig(**over)
    if args.torch_varlen:  # the A/B of kernels/flash_varlen.py: torch's custom op instead
        from torch.nn.attention.varlen import varlen_attn

        from conveyor.trainer import packing
        packing._flash_varlen = lambda: varlen_attn
    if world == 1:
        from conveyor.trainer.single import LocalTrainer
        return LocalTrainer(path, cfg, total_steps=100)
    from conveyor.trainer.fsdp import FSDPTrainer
    return FSDPTrainer(path, cfg, total_steps=100)


def _run(rank: int, world: int, args, path: str, port: int, q) -> None:
    import torch

    from conveyor.config import AlgoConfig
    from conveyor.controller.objective import PolicyLoss
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    if world > 1:
        import datetime

        import torch.distributed as dist
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=300))
    trainer = _trainer(args, path, rank, world)
    vocab = trainer.model.config.vocab_size
    batch, lens = _batch(args, vocab)
    loss = PolicyLoss(AlgoConfig(advantage="grpo", loss="ppo", clip_low=0.2, clip_high=0.2))
    t0 = time.perf_counter()
    trainer.train(batch, loss)  # warm-up: allocator, kernels, compilation
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.train(batch, loss)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    varied = []
    for k in range(args.vary):
        # A new batch (new lengths, so new micro-batch shapes) each step, as inside the RL loop.
        other, _ = _batch(args, vocab, seed=1 + k)
        t0 = time.perf_counter()
        trainer.train(other, loss)
        if cuda:
            torch.cuda.synchronize()
        varied.append(time.perf_counter() - t0)
    prof = None
    # The profiled step gets a new batch too when --vary is given: that is the slow case.
    pbatch = _batch(args, vocab, seed=1000)[0] if args.vary else batch
    if args.profile and cuda and rank == 0:
        from torch.profiler import ProfilerActivity, profile
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.gaps) as pr:
            trainer.train(pbatch, loss)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        avg = pr.key_averages()
        gaps = ""
        if args.gaps:
            from benchmarks.gpu_gaps import idle_report
            trace = Path(args.out) / f"trainer-{args.model}-r{world}-trace.json"
            trace.parent.mkdir(parents=True, exist_ok=True)
            pr.export_chrome_trace(str(trace))
            gaps = idle_report(str(trace), top=args.profile) + "\n"
            trace.unlink()  # hundreds of MB; the report is what is kept
        # Wall time against the sum of kernel time tells a GPU-bound step from one stalled on the host.
        kernels = sum(e.self_device_time_total for e in avg if e.device_type.name == "CUDA") / 1e6
        prof = (f"profiled step: wall {wall:.3f} s (under the profiler), kernels {kernels:.3f} s\n" + gaps
                + avg.table(sort_by="cuda_time_total", row_limit=args.profile) + "\n"
                + avg.table(sort_by="self_cpu_time_total", row_limit=min(args.profile, 20)))
    elif args.profile and world > 1:
        trainer.train(pbatch, loss)  # the other ranks join rank 0's profiled step
    gather_ms = {}
    if args.gather and world > 1:
        # What a publish costs a sharded trainer before any transport: every full tensor in bf16.
        # bucket 0 MiB = one all-gather per tensor; the default packs 256 MiB of shards per all-gather.
        for bucket_mb in (0.0, 256.0, 0.0, 256.0):
            t0 = time.perf_counter()
            for _ in trainer.named_weights(torch.bfloat16, bucket_mb=bucket_mb):
                pass
            if cuda:
                torch.cuda.synchronize()
            gather_ms.setdefault(str(bucket_mb), []).append((time.perf_counter() - t0) * 1e3)
    res = {"rank": rank, "times": times, "warmup_s": warmup_s, "gather_ms": gather_ms, "varied": varied,
           "completion_tokens": sum(lens), "sequences": len(lens),
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "profile": prof}
    q.put(res)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


def main(argv=None) -> int:
    import torch
    import torch.multiprocessing as mp

    from benchmarks.bounds import SHAPES, device_spec, param_count
    from benchmarks.models import build_w1_model
    from conveyor.launch.placement import free_port
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--out", default="runs/trainer")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--target-mean", type=float, default=256.0)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="trainer.compile=true")
    p.add_argument("--logprob-chunk-rows", type=int, default=1024, help="0: the plain logprob head")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, help="rows of the kernel table (0: no profile)")
    p.add_argument("--torch-varlen", action="store_true",
                   help="packed attention through torch's varlen_attn instead of the direct aten call (A/B)")
    p.add_argument("--gaps", action="store_true",
                   help="with --profile: the GPU's idle gaps by the host code that was running (benchmarks/gpu_gaps.py)")
    p.add_argument("--pad-multiple", type=int, default=1, help="trainer.pad_multiple")
    p.add_argument("--attention-mask", action="store_true", help="trainer.attention_mask=true (the padding mask)")
    p.add_argument("--param-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="trainer.param_dtype (float32: the master weights under bf16 autocast)")
    p.add_argument("--no-kernel", action="store_true", help="trainer.kernels=false (torch RMSNorm and chunked torch head)")
    p.add_argument("--fsdp-reshard", default="micro-batch", choices=["micro-batch", "step"],
                   help="trainer.fsdp_reshard (--ranks > 1): free gathered layers per micro-batch or per step")
    p.add_argument("--pack", default="auto", choices=["auto", "on", "off"], help="trainer.pack_sequences")
    p.add_argument("--tag", default="", help="suffix of the output file name")
    p.add_argument("--vary", type=int, default=0,
                   help="then time this many steps on a new batch each (other lengths), as in the RL loop")
    p.add_argument("--gather", action="store_true", help="also time named_weights(bf16), per tensor vs bucketed")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = "float32" if args.model == "tiny" else "bfloat16"
    path = str(build_w1_model(out / f"model-{args.model}", args.model, seed=0, dtype=dtype))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, args.ranks, args, path, port, q)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    results = sorted((q.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for pr in procs:
        pr.join(60)
    r0 = results[0]
    step_s = sum(r0["times"]) / len(r0["times"])
    shape = SHAPES[args.model]
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = device_spec(name)["peak_flops"]
    total_tokens = args.prompts * args.group * args.prompt_len + r0["completion_tokens"]
    tok_s = total_tokens / step_s
    record = {"model": args.model, "ranks": args.ranks, "device": name, "step_s": step_s, "times": r0["times"],
              "warmup_s": r0["warmup_s"], "gather_ms": r0["gather_ms"], "varied_times": r0["varied"],
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "tokens_per_step": total_tokens, "tokens_per_s": tok_s,
              "mfu": 6 * param_count(shape) * tok_s / (peak * args.ranks) if peak else None,
              "micro_batch_tokens": args.micro_batch_tokens, "checkpointing": args.checkpointing,
              "compile": args.compile, "logprob_chunk_rows": args.logprob_chunk_rows, "pad_multiple": args.pad_multiple,
              "attention_mask": args.attention_mask, "param_dtype": args.param_dtype,
              "kernels": not args.no_kernel, "fsdp_reshard": args.fsdp_reshard, "pack_sequences": args.pack,
              "torch_varlen": args.torch_varlen,
              "peak_mem_gb": [r["peak_mem_gb"] for r in results], "date": time.strftime("%Y-%m-%d")}
    tag = ("" if args.logprob_chunk_rows == 1024 else f"-chunk{args.logprob_chunk_rows}") + args.tag
    (out / f"trainer-{args.model}-r{args.ranks}{tag}.json").write_text(json.dumps(record, indent=2))
    from benchmarks.harness import append_record
    cfg_keys = ("model", "ranks", "alloc_conf", "micro_batch_tokens", "checkpointing", "compile", "logprob_chunk_rows",
                "pad_multiple", "attention_mask", "param_dtype", "kernels", "fsdp_reshard", "pack_sequences", "torch_varlen")
    gpu = torch.cuda.is_available()
    append_record("trainer", {k: v for k, v in record.items() if k not in cfg_keys and k not in ("device", "date")},
                  config={k: record[k] for k in cfg_keys}, name=f"trainer-{args.model}-r{args.ranks}{tag}",
                  card=name if gpu else None, gpu=gpu)
    print(json.dumps(record))
    if r0["profile"]:
        print(r0["profile"])
        (out / f"trainer-{args.model}-r{args.ranks}{tag}-profile.txt").write_text(r0["profile"])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
