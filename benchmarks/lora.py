"""LoRA against full fine-tuning: trainer memory and samples/s on W1's shape, publish merged vs adapter.

    python benchmarks/lora.py --model qwen2.5-1.5b --out runs/lora                  # one GPU (W1, 1.5B)
    python benchmarks/lora.py --model tiny --prompts 2 --group 2 --max-new-tokens 16 --steps 1 \
        --out runs/lora-cpu                                                          # CPU smoke
    python benchmarks/lora.py --learning --out runs/lora-learning                   # default CPU recipe

Contract: builds W1's random-init model (``models.build_w1_model``) and one
batch of ``--prompts x --group`` sequences with W1's heavy-tailed completion
lengths (``trainer_gpu._batch``), then for each mode in turn (``full``,
``lora``: ``trainer.lora`` with ``--rank``, ``--alpha``, the default targets)
builds a ``LocalTrainer`` (lr 1e-6 as W1, or ``--lr``), runs one warm-up
``train()`` and times ``--steps`` more: seconds per step, trained samples/s,
peak allocated device memory during the timed steps (CUDA only) and the
optimizer's state bytes. Then it times a publish of each form into one
``NativeEngine`` in the engine dtype (bf16 on a GPU): the trainer's tensors
through a ``StagedWeights`` staging copy on the device (``publish_ms``) and the
engine's ``update_weights`` from it (``apply_ms``, which for ``adapter`` includes
the engine's merge), with the bytes each form moves. Records go to
``<out>/lora-<model>.json`` and are appended to ``benchmarks/results/lora(_cpu).jsonl``.

``--learning`` instead runs the built-in default recipe (CPU, tiny model)
twice, full fine-tuning and ``trainer.lora`` (``--learning-lr``), with the same
seed and warm start, and records each run's held-out reward before and after
RL and its trained samples/s (``lora_learning_cpu.jsonl``).

It measures the trainer and the weight path alone: no rollouts (but ``--learning``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer_cfg(args, mode: str, publish: str = "merged"):
    from conveyor.config import TrainerConfig
    lora = {"enabled": mode == "lora", "rank": args.rank, "alpha": args.alpha, "publish": publish,
            "target_modules": DEFAULT_TARGETS}
    return TrainerConfig(lr=args.lr, micro_batch_tokens=args.micro_batch_tokens, max_grad_norm=1.0,
                         gradient_checkpointing=args.checkpointing, lora=lora)


def _optimizer_bytes(trainer) -> int:
    return sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
               for t in s.values() if hasattr(t, "numel"))


def time_training(args, path: str, mode: str) -> dict:
    """Warm-up plus ``args.steps`` timed train calls of one mode."""
    import torch

    from benchmarks.trainer_gpu import _batch
    from conveyor.config import AlgoConfig
    from conveyor.controller.objective import PolicyLoss
    from conveyor.trainer.single import LocalTrainer
    # What an earlier mode left allocated (should be ~0: each mode's peak is its own).
    before = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
    trainer = LocalTrainer(path, _trainer_cfg(args, mode), total_steps=100)
    batch, lens = _batch(args, trainer.model.config.vocab_size)
    loss = PolicyLoss(AlgoConfig(advantage="grpo", loss="ppo", clip_low=0.2, clip_high=0.2))
    trainer.train(batch, loss)  # warm-up: allocator, kernels, the optimizer's state
    cuda = trainer.device.type == "cuda"
    _sync(trainer.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        trainer.train(batch, loss)
        _sync(trainer.device)
        times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    res = {"mode": mode, "step_s": step_s, "times": times, "samples_per_s": len(lens) / step_s,
           "peak_mem_gib": torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else None,
           "optimizer_state_gib": _optimizer_bytes(trainer) / 2**30, "trainable_params": trainable,
           "allocated_before_gib": before}
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def time_publish(args, path: str, engine) -> dict:
    """One adapted trainer (a step taken, so B != 0) published merged and adapter-only into ``engine``."""
    import torch

    from benchmarks.trainer_gpu import _batch
    from conveyor.config import AlgoConfig
    from conveyor.controller.objective import PolicyLoss
    from conveyor.trainer.single import LocalTrainer
    from conveyor.transport.adapter import adapter_specs
    from conveyor.transport.weights import StagedWeights, publish_all, weight_specs
    param = next(engine.model.parameters())
    dtype, engine_device = param.dtype, param.device
    out = {}
    for publish in ("merged", "adapter"):
        trainer = LocalTrainer(path, _trainer_cfg(args, "lora", publish).model_copy(update={"lr": 1e-3}),
                               total_steps=10)
        batch, _ = _batch(args, trainer.model.config.vocab_size)
        trainer.train(batch, PolicyLoss(AlgoConfig(advantage="grpo", loss="ppo")))
        specs = (adapter_specs(path, DEFAULT_TARGETS, args.rank) if publish == "adapter"
                 else weight_specs(path))
        staging = StagedWeights([(n, s, dtype) for n, s, _ in specs], None, device=engine_device)
        pub, app = [], []
        for v in range(1, args.publishes + 1):
            _sync(trainer.device)
            t0 = time.perf_counter()
            publish_all([staging], trainer.named_weights(dtype), v)  # commit synchronizes the copies
            t1 = time.perf_counter()
            staging.poll(engine)
            _sync(engine_device)
            pub.append((t1 - t0) * 1e3)
            app.append((time.perf_counter() - t1) * 1e3)
        out[publish] = {"publish_ms": min(pub), "apply_ms": min(app), "publish_ms_all": pub,
                        "apply_ms_all": app, "tensors": len(specs),
                        "bytes_mib": sum(t.numel() * t.element_size() for t in staging.tensors) / 2**20}
        del trainer, staging
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def run_shape(args) -> dict:
    import torch

    from benchmarks.models import build_w1_model
    from conveyor.rollout.native.engine import NativeEngine
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    path = str(build_w1_model(out / f"model-{args.model}", args.model, seed=0,
                              dtype="bfloat16" if gpu else "float32"))
    modes = [time_training(args, path, m) for m in ("full", "lora")]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    engine = NativeEngine(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                          device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                          runner="hf")  # the swap is the same for both runners; hf allocates no KV pool
    publish = time_publish(args, path, engine)
    full, lo = modes
    return {"model": args.model, "device": torch.cuda.get_device_name(0) if gpu else "cpu",
            "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
            "rank": args.rank, "alpha": args.alpha, "steps": args.steps, "modes": modes, "publish": publish,
            "memory_ratio": (lo["peak_mem_gib"] / full["peak_mem_gib"]) if gpu else None,
            "speedup": lo["samples_per_s"] / full["samples_per_s"]}


def run_learning(args) -> list[dict]:
    """The default recipe, full fine-tuning and LoRA, same seed: held-out reward and samples/s."""
    from conveyor import api
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {"full": [], "lora": ["trainer.lora.enabled=true", f"trainer.lr={args.learning_lr}",
                                 f"trainer.lora.rank={args.rank}", f"trainer.lora.alpha={args.alpha}"]}
    recs = []
    for mode, extra in runs.items():
        cfg = api.load_config(None, ["observe.progress=false", "observe.tensorboard=false",
                                     f"loop.seed={args.seed}", *args.override, *extra])
        s = api.train(cfg, run_dir=out / f"{mode}-seed{args.seed}").raw
        recs.append({"mode": mode, "seed": args.seed, "lr": cfg.trainer.lr,
                     "eval_warmstart": s["eval_reward_warmstart"], "eval_final": s["eval_reward_final"],
                     "gain": s["eval_reward_final"] - s["eval_reward_warmstart"],
                     "sampled_gain": s["eval_sampled_reward_final"] - s["eval_sampled_reward_warmstart"],
                     "samples_per_s": s["trained_samples_per_second"], "wall_s": s["wall_seconds"]})
        print(json.dumps(recs[-1]), flush=True)
    return recs


def main(argv=None) -> int:
    from benchmarks.bounds import SHAPES
    from benchmarks.harness import append_record
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--out", default="runs/lora")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--target-mean", type=float, default=256.0)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--checkpointing", action="store_true", help="trainer.gradient_checkpointing=true")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--publishes", type=int, default=3, help="publishes timed per form (the fastest is reported)")
    p.add_argument("--learning", action="store_true", help="the default CPU recipe, full vs LoRA")
    p.add_argument("--learning-lr", type=float, default=3e-3, help="--learning: the LoRA run's trainer.lr")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], help="--learning: conveyor key=value for both runs")
    args = p.parse_args(argv)
    if args.learning:
        for rec in run_learning(args):
            append_record("lora_learning", {k: v for k, v in rec.items() if k not in ("mode", "seed", "lr")},
                          config={"mode": rec["mode"], "seed": rec["seed"], "lr": rec["lr"], "rank": args.rank,
                                  "alpha": args.alpha, "overrides": args.override},
                          name=f"lora-learning-{rec['mode']}", gpu=False)
        return 0
    rec = run_shape(args)
    (Path(args.out) / f"lora-{args.model}.json").write_text(json.dumps(rec, indent=2))
    gpu = rec["device"] != "cpu"
    metrics = {f"{m['mode']}_{k}": m[k] for m in rec["modes"]
               for k in ("step_s", "samples_per_s", "peak_mem_gib", "optimizer_state_gib", "trainable_params")}
    for form, r in rec["publish"].items():
        metrics.update({f"publish_{form}_{k}": r[k] for k in ("publish_ms", "apply_ms", "bytes_mib")})
    metrics.update(memory_ratio=rec["memory_ratio"], speedup=rec["speedup"])
    config = {k: rec[k] for k in ("model", "prompts", "group", "max_new_tokens", "rank", "alpha", "steps")}
    append_record("lora", metrics, config=config, name=f"lora-{args.model}", card=rec["device"] if gpu else None,
                  gpu=gpu)
    print(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
