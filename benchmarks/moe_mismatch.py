"""How far a mixture-of-experts trainer drifts from its engine, and what routing replay takes back.

The engine (native, Hugging Face runner, ``--engine-dtype``, bf16 by default) samples completions
of random prompts from a randomly initialised Qwen3-MoE model and records the experts each fed
token was routed to. The trainer (``LocalTrainer``: float32 on CPU, bf16 autocast on a GPU)
then recomputes the completions' logprobs twice, on its own routing and replaying the record.
Printed per configuration:
- routing: the fraction of scored positions (those whose output is a completion token's logprob)
  where the trainer's own experts differ from the engine's in at least one layer, and the mean
  over layers of the per-layer fraction (expert sets compared, order ignored);
- logprobs: max and mean |trainer - engine| over completion tokens, without and with replay;
- importance ratios exp(trainer - engine): p1 / p50 / p99 and the fraction outside [0.8, 1.2]
  (PPO's clip range), without and with replay.
One summary line goes to benchmarks/results/moe_mismatch{,_cpu}.jsonl.

    python benchmarks/moe_mismatch.py --shape tiny                 # CPU: engine bf16, trainer fp32
    python benchmarks/moe_mismatch.py --shape gpu --device cuda    # one GPU: engine bf16, trainer bf16 autocast
    python benchmarks/moe_mismatch.py --shape gpu --device cuda --trainer-fp32   # trainer float32

``gpu`` is Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads of 128, 128 experts of width 768, top 8,
renormalised top-k weights, vocabulary 151,936) with ``--layers`` layers (4 by default).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

from conveyor import routing
from conveyor.config import TrainerConfig
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.trainer.microbatch import collate, plan_microbatches
from conveyor.trainer.single import LocalTrainer
from conveyor.types import Batch


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int
    vocab: int


SHAPES = {
    "tiny": Shape(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, experts=16, top_k=4, expert_width=64,
                  vocab=128),
    "gpu": Shape(hidden=2048, layers=4, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, expert_width=768,
                 vocab=151_936),
}


def build(shape: Shape, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    config = Qwen3MoeConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.expert_width * 8, moe_intermediate_size=shape.expert_width,
        num_experts=shape.experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1_000_000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def trainer_pass(trainer: LocalTrainer, batch: Batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The trainer's logprobs of ``batch`` and, per sample, the experts its own routers chose
    ``[len, layers, k]`` (read back from the micro-batches ``logprobs`` runs, in plan order)."""
    lengths = [int(x.numel()) for x in batch.input_ids]
    lps, flat = routing.own_routes(trainer.compute, lambda: trainer.logprobs(batch))
    own: list[torch.Tensor | None] = [None] * len(batch)
    at = 0
    for idx in plan_microbatches(lengths, trainer.cfg.micro_batch_tokens, trainer.cfg.pad_multiple):
        width = collate(batch, idx, 0, trainer.cfg.pad_multiple)["input_ids"].shape[1]
        block = flat[at: at + len(idx) * width].view(len(idx), width, *flat.shape[1:]).cpu()
        at += len(idx) * width
        for row, i in enumerate(idx):
            own[i] = block[row, : lengths[i]]
    return lps, own  # type: ignore[return-value]


def quantiles(x: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(x.double(), torch.tensor([0.01, 0.5, 0.99], dtype=torch.double))
    return {"p1": float(q[0]), "p50": float(q[1]), "p99": float(q[2]),
            "outside_clip": float(((x < 0.8) | (x > 1.2)).double().mean())}


def measure(args, shape: Shape) -> dict:
    model = build(shape, args.seed)
    engine = NativeEngine(copy.deepcopy(model), None, device=args.device, dtype=args.engine_dtype,
                          max_batch=args.prompts * args.n, runner="hf", record_experts=True)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [[1, *torch.randint(3, shape.vocab, (args.prompt_len - 1,), generator=gen).tolist()]
               for _ in range(args.prompts)]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=args.new, n=args.n, seed=args.seed))
    gen_s = time.perf_counter() - t0
    engine.close()
    samples = [(p, c) for p, cs in zip(prompts, outs) for c in cs]
    ids = [torch.tensor(p + c.token_ids) for p, c in samples]
    masks = [torch.cat([torch.zeros(len(p)), torch.ones(len(c.token_ids))]) for p, c in samples]
    routes = [torch.from_numpy(c.routed_experts).long() for _, c in samples]
    precision = {"param_dtype": "float32", "autocast_bf16": False} if args.trainer_fp32 else {}
    trainer = LocalTrainer(model, TrainerConfig(device=args.device, micro_batch_tokens=args.micro_batch_tokens,
                                                **precision), total_steps=1)
    t0 = time.perf_counter()
    plain, own = trainer_pass(trainer, Batch(ids, masks))
    replayed = trainer.logprobs(Batch(ids, masks, routes=routes))
    train_s = time.perf_counter() - t0
    differ_any, differ_layer, engine_lp, lp_plain, lp_replay = [], [], [], [], []
    for (p, c), o, r, a, b in zip(samples, own, routes, plain, replayed):
        scored = slice(len(p) - 1, len(p) + len(c.token_ids) - 1)  # outputs that score completion tokens
        rec, mine = r[scored].sort(-1).values, o[scored].sort(-1).values
        layer_differs = (rec[: len(mine)] != mine[: len(rec)]).any(-1)  # [positions, layers]
        differ_any.append(layer_differs.any(-1))
        differ_layer.append(layer_differs.float())
        engine_lp.append(torch.tensor(c.logprobs))
        lp_plain.append(a[len(p):])
        lp_replay.append(b[len(p):])
    e, lp0, lp1 = torch.cat(engine_lp), torch.cat(lp_plain), torch.cat(lp_replay)
    d0, d1 = (lp0 - e).abs(), (lp1 - e).abs()
    per_layer = torch.cat(differ_layer).mean(0)
    return {
        "sequences": len(samples), "completion_tokens": int(e.numel()),
        "routing_differs_any_layer": float(torch.cat(differ_any).float().mean()),
        "routing_differs_per_layer_mean": float(per_layer.mean()),
        "routing_differs_per_layer": [round(float(x), 4) for x in per_layer],
        "logprob_absdiff_max": float(d0.max()), "logprob_absdiff_mean": float(d0.mean()),
        "logprob_absdiff_max_replay": float(d1.max()), "logprob_absdiff_mean_replay": float(d1.mean()),
        "ratio": quantiles(torch.exp(lp0 - e)), "ratio_replay": quantiles(torch.exp(lp1 - e)),
        "generate_s": gen_s, "trainer_s": train_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompts", type=int, default=None, help="default 16 (tiny) / 64 (gpu)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=None, help="default 16 (tiny) / 128 (gpu)")
    p.add_argument("--new", type=int, default=None, help="new tokens per sample; default 32 (tiny) / 256 (gpu)")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--trainer-fp32", action="store_true", help="on a GPU: trainer in float32, no autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-record", action="store_true", help="print only; append nothing to benchmarks/results")
    args = p.parse_args(argv)
    gpu = args.shape == "gpu"
    args.prompts = args.prompts or (64 if gpu else 16)
    args.prompt_len = args.prompt_len or (128 if gpu else 16)
    args.new = args.new or (256 if gpu else 32)
    shape = SHAPES[args.shape]
    if args.layers:
        shape = Shape(**{**shape.__dict__, "layers": args.layers})
    metrics = measure(args, shape)
    on_gpu = str(args.device).startswith("cuda")
    card = torch.cuda.get_device_name() if on_gpu else None
    trainer_dtype = "bf16 autocast" if on_gpu and not args.trainer_fp32 else "float32"
    print(f"{args.shape} ({shape.layers} layers, {shape.experts} experts, top {shape.top_k}) on {card or 'CPU'}: "
          f"engine {args.engine_dtype} vs trainer {trainer_dtype}, {metrics['sequences']} sequences, "
          f"{metrics['completion_tokens']} completion tokens")
    print(f"  experts differ: {metrics['routing_differs_any_layer']:.1%} of scored tokens in at least one layer, "
          f"{metrics['routing_differs_per_layer_mean']:.2%} per layer (mean; by layer {metrics['routing_differs_per_layer']})")
    for tag, sfx in (("own routing", ""), ("routing replay", "_replay")):
        r = metrics["ratio" + sfx]
        print(f"  {tag:15s} |dlogprob| max {metrics['logprob_absdiff_max' + sfx]:.4f} mean "
              f"{metrics['logprob_absdiff_mean' + sfx]:.5f}; ratio p1 {r['p1']:.4f} p50 {r['p50']:.4f} "
              f"p99 {r['p99']:.4f}, outside [0.8, 1.2] {r['outside_clip']:.2%}")
    if not args.no_record:
        from benchmarks.harness import append_record
        config = {"shape": args.shape, **shape.__dict__, "engine_dtype": args.engine_dtype,
                  "trainer_dtype": trainer_dtype, "prompts": args.prompts, "n": args.n,
                  "prompt_len": args.prompt_len, "new": args.new, "seed": args.seed}
        path = append_record("moe_mismatch", metrics, config=config, card=card, gpu=on_gpu)
        print(f"  recorded in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
