"""TRL's GRPOTrainer as the in-run peer: ``python -m benchmarks.peers.trl_peer SPEC.json``.

Contract: reads the same ``workloads.run_config(spec)`` conveyor runs
under and maps it field by field onto ``GRPOConfig`` (``grpo_args``):
same checkpoint, prompts in conveyor's cursor order (``shuffle_dataset``
off, so step k sees exactly conveyor's step-k tasks), group size, sampling
(temperature, top-p, top-k, max new tokens, EOS bias as ``sequence_bias``),
reward, AdamW (lr, betas, weight decay, eps 1e-8, constant schedule, no
warmup), gradient clipping, PPO clip, no KL, ``mini_batches`` optimizer
steps per ``batch_size x n`` generated samples (``ppo_epochs`` passes),
token-mean aggregation ("dapo": normalised by the loss tokens of an
optimizer step; TRL estimates that count as the generation batch's total
divided by the number of steps, conveyor counts it exactly). Anything
without a TRL equivalent raises ``ValueError`` naming the field, and the
row reports it.

Known differences, kept on purpose and reported in benchmarks/README.md
(also: with several optimizer steps per batch TRL recomputes the old
log-probabilities in an extra forward where conveyor uses the engine's,
and TRL shuffles samples across mini-batches where conveyor keeps
contiguous chunks):
TRL's group std is the sample std (n - 1) with eps 1e-4, conveyor's the
population std with eps 1e-6 (TRL advantages are sqrt((n-1)/n) smaller;
Adam is scale-invariant up to its eps, gradient clipping is not); TRL
generates with the training model (fp32 weights, bf16 autocast on GPU)
where conveyor's engine holds its own copy in the checkpoint dtype.

Phase times come from timing ``_generate_single_turn`` (generate),
the reward function (reward), the rest of ``_generate_and_score_completions``
(prepare) and the remainder of the optimizer step (train), written to
``metrics.jsonl`` in conveyor's format. It knows nothing of conveyor's loop.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.bounds import describe_machine
from benchmarks.evaluate import evaluate_checkpoint
from benchmarks.lengths import trl_generation_kwargs
from benchmarks.peers.common import gpu_memory, load_spec, spec_path_from_argv, write_result
from benchmarks.rewards import TrlReward
from benchmarks.workloads import TRAJECTORIES, run_config, samples_per_step

_LOSS_AGG = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
_SCALE = {"grpo": "group", "drgrpo": "none"}
MAX_DATASET_STEPS = 5000  # prompts are materialised for at most this many steps; TRL cycles after that


def _check_supported(cfg) -> None:
    a, t = cfg.algo, cfg.trainer
    problems = []
    if a.loss != "ppo":
        problems.append(f"algo.loss={a.loss} (TRL peer maps only ppo)")
    if a.advantage not in _SCALE:
        problems.append(f"algo.advantage={a.advantage} (TRL has grpo and drgrpo only)")
    if a.loss_agg not in _LOSS_AGG:
        problems.append(f"algo.loss_agg={a.loss_agg} (no TRL loss_type)")
    if a.kl_coef or a.entropy_coef or a.importance_sampling != "none" or a.dual_clip:
        problems.append("KL, entropy bonus, importance sampling and dual clip are not mapped")
    if t.lr_schedule != "constant" or t.warmup_steps:
        problems.append("trainer: only a constant lr without warmup is mapped")
    if samples_per_step(cfg) % t.mini_batches:
        problems.append(f"trainer.mini_batches={t.mini_batches} must divide the {samples_per_step(cfg)} samples "
                        "of a step (TRL splits a generation batch evenly)")
    if problems:
        raise ValueError("TRL peer cannot reproduce this config: " + "; ".join(problems))


def optimizer_steps_per_rollout_batch(cfg) -> int:
    """conveyor's ppo_epochs x mini_batches optimizer steps per batch = TRL global steps per generation."""
    return cfg.trainer.ppo_epochs * cfg.trainer.mini_batches


def grpo_args(cfg, spec: dict, out_dir: Path, cuda: bool, eos_id: int, max_steps: int):
    """``max_steps`` counts rollout batches (conveyor loop steps), as the spec does."""
    from trl import GRPOConfig
    _check_supported(cfg)
    per_update = samples_per_step(cfg) // cfg.trainer.mini_batches   # samples behind one optimizer step
    micro = int(spec.get("trl_micro_batch") or per_update)
    if per_update % micro:
        raise ValueError(f"trl_micro_batch={micro} must divide the {per_update} samples of an optimizer step")
    accum = per_update // micro
    r, t, a = cfg.rollout, cfg.trainer, cfg.algo
    return GRPOConfig(
        output_dir=str(out_dir), seed=cfg.loop.seed, report_to="none",
        max_steps=max_steps * optimizer_steps_per_rollout_batch(cfg),
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=not cuda, bf16=bool(cuda and t.autocast_bf16), fp16=False,
        gradient_checkpointing=t.gradient_checkpointing,
        # optimizer: AdamW exactly as conveyor's LocalTrainer builds it
        optim="adamw_torch", learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=t.weight_decay, adam_beta1=t.betas[0], adam_beta2=t.betas[1], adam_epsilon=1e-8,
        max_grad_norm=t.max_grad_norm or 0.0,
        # batch_size x n samples generated at once, cut into mini_batches optimizer steps (ppo_epochs passes)
        per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        steps_per_generation=accum * cfg.trainer.mini_batches,
        num_generations=r.n, num_iterations=t.ppo_epochs, shuffle_dataset=False,
        # sampling
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        generation_kwargs=trl_generation_kwargs(r.eos_bias, eos_id) or None,
        # objective
        beta=0.0, epsilon=a.clip_low, epsilon_high=a.clip_high, loss_type=_LOSS_AGG[a.loss_agg],
        scale_rewards=_SCALE[a.advantage], mask_truncated_completions=False, log_completions=False,
    )


def ordered_rows(cfg, tokenizer, steps: int) -> list[dict]:
    """The tasks conveyor's TaskCursor yields for ``steps`` steps, as dataset rows, in that order."""
    from conveyor.data.api import TaskCursor
    from conveyor.run.session import load_sources
    train_src, _ = load_sources(cfg, tokenizer)
    cursor = TaskCursor(train_src, cfg.loop.batch_size, seed=cfg.loop.seed)
    rows = []
    for _ in range(steps):
        for task in cursor.next_batch():
            rows.append({"prompt": task.prompt, "answer": task.answer or "",
                         "task": (task.info or {}).get("task", "")})
    return rows


def _trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that accumulates the seconds spent generating and scoring."""
        bench_generate_s = 0.0
        bench_score_s = 0.0

        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.bench_generate_s += time.perf_counter() - t0

        def _generate_and_score_completions(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*args, **kwargs)
            finally:
                self.bench_score_s += time.perf_counter() - t0

    return TimedGRPOTrainer


def _phase_callback(run_dir: Path, reward: TrlReward, samples: int, per_batch: int, budget_s: float | None):
    from transformers import TrainerCallback

    class PhaseLog(TrainerCallback):
        """Writes one metrics.jsonl line per rollout batch (``per_batch`` optimizer steps, as conveyor
        logs one per loop step) and stops at the wall budget, checked where conveyor checks it."""

        def __init__(self):
            self.trainer = None
            self.file = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
            self.prev = (0.0, 0.0, 0.0)

        def on_train_begin(self, args, state, control, **kw):
            self.t_begin = self.t_last = time.perf_counter()
            self.rl_start_unix = time.time()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % per_batch:
                return control
            now = time.perf_counter()
            tr = self.trainer
            cur = (tr.bench_generate_s, tr.bench_score_s, reward.seconds)
            gen, score, rew = (c - p for c, p in zip(cur, self.prev))
            self.prev = cur
            step_s = now - self.t_last
            self.t_last = now
            rec = {"step": state.global_step // per_batch, "kind": "train", "time": time.time(),
                   "time/generate": gen, "time/reward": rew, "time/prepare": max(score - gen - rew, 0.0),
                   "time/train": max(step_s - score, 0.0), "time/step": step_s, "num_seqs": float(samples),
                   "samples_per_s": samples / max(step_s, 1e-9)}
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
            if budget_s and now - self.t_begin > budget_s:
                control.should_training_stop = True
            return control

    return PhaseLog()


def train(cfg, spec: dict, run_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    max_steps = int(spec["max_steps"])
    rows = ordered_rows(cfg, tok, min(max_steps, MAX_DATASET_STEPS))
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
    eos_ids = {tok.eos_token_id, *gen_eos}
    per_batch = optimizer_steps_per_rollout_batch(cfg)
    reward = TrlReward("partial_credit" if spec["workload"] == "w2" else "hash", str(run_dir / TRAJECTORIES),
                       eos_ids, lambda p: len(tok(p)["input_ids"]), seed=int(spec.get("reward_seed", 0)),
                       steps_per_version=per_batch)
    args = grpo_args(cfg, spec, run_dir / "trl", cuda, tok.eos_token_id, max_steps)
    callback = _phase_callback(run_dir, reward, samples_per_step(cfg), per_batch, spec.get("budget_s"))
    trainer = _trainer_class()(model=model, reward_funcs=[reward], args=args,
                               train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[callback])
    callback.trainer = trainer
    t0 = time.perf_counter()
    trainer.train()
    rl_seconds = time.perf_counter() - t0
    callback.file.close()
    out = {"steps": trainer.state.global_step // per_batch, "optimizer_steps": trainer.state.global_step,
           "rl_seconds": rl_seconds, "rl_start_unix": callback.rl_start_unix,
           "trl_log_tail": trainer.state.log_history[-3:], "trl_args": {
               k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                             "loss_type", "scale_rewards", "epsilon", "bf16", "generation_kwargs")}}
    if spec["workload"] == "w2":
        trainer.save_model(str(run_dir / "final"))
        tok.save_pretrained(run_dir / "final")
    return out


def main() -> int:
    spec = load_spec(spec_path_from_argv())
    run_dir = Path(spec["run_dir"])
    cfg = run_config(spec)
    result: dict = {"system": "trl", "machine": describe_machine()}
    result.update(train(cfg, spec, run_dir))
    if spec["workload"] == "w2":
        result["eval_after"] = evaluate_checkpoint(cfg, run_dir / "final", run_dir / "eval_after")
    result.update(gpu_memory())
    write_result(run_dir, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
