"""The embedded launcher: every role in this process, on this machine.

Contract: ``run_local(cfg, run_dir, resume)`` builds the roles (model and
tokenizer, trainer, rollout engine, reward service, task sources, metrics),
evaluates the initial policy, runs the supervised warm-start when
``sft.steps > 0``, runs ``loop.rl_loop``, evaluates again and writes
``summary.json``, a final HF checkpoint and the resolved config into
``run_dir``. With ``resume`` it restores the latest checkpoint in
``run_dir/checkpoints`` and continues. It knows which role implementation
to pick for a config, and nothing of the formulas or the loop's schedule.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor import loop
from conveyor.config import RunConfig, save_config

log = logging.getLogger("conveyor")


class SetupError(ValueError):
    """A run that cannot start; the message names the thing and the fix."""


@dataclass
class Components:
    cfg: RunConfig
    run_dir: Path
    tokenizer: Any
    rewards: Any
    train_source: Any
    eval_tasks: list
    cursor: Any
    logger: Any
    timer: Any
    buffer: Any
    add_special_tokens: bool
    trainer: Any = None      # TrainerHost (in-process) or TrainerProxy (trainer rank processes)
    producer: Any = None
    weights: Any = None      # where the controller publishes warm-start weights
    placement: Any = None
    routes: Any = None
    max_prompt_tokens: int = 0
    stats: dict = field(default_factory=dict)

    def checkpoint(self, step: int, summary: dict) -> Path:
        path = self.run_dir / "checkpoints" / f"step_{step:06d}"
        # With max_staleness > 0, groups of later steps may already be in flight; they are
        # regenerated after a resume (the cursor is saved as of this step's boundary).
        # (The producer records the state before it draws, so if it has not recorded it
        # after our read, our read was before its draw.)
        now = self.cursor.state_dict()
        cursor = self.producer.cursor_at_step.get(step, now)
        self.trainer.save_checkpoint(path, {"step": step, "cursor": cursor, "summary": summary})
        self.tokenizer.save_pretrained(path / "policy")
        return path

    def close(self) -> None:
        from conveyor.launch.roles import stop_engines
        if self.producer is not None:
            self.producer.stop()
            stop_engines(self.producer.engines)
        if self.trainer is not None and hasattr(type(self.trainer), "close"):
            self.trainer.close()
        self.rewards.close()
        self.logger.close()


def resolve_model_path(cfg: RunConfig, run_dir: Path) -> str:
    if cfg.model.path is None:
        out = run_dir / "base_model"
        if not (out / "config.json").exists():
            from conveyor.data.tiny import build_tiny
            t = cfg.model.tiny
            build_tiny(out, t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads,
                       t.intermediate_size, t.max_position_embeddings, seed=cfg.loop.seed)
        return str(out)
    p = cfg.model.path
    looks_local = p.startswith((".", "/", "~")) or Path(p).exists() or p.count("/") != 1
    if looks_local and not (Path(p).expanduser() / "config.json").exists():
        raise SetupError(f"model.path {p!r} is not a Hugging Face checkpoint directory (no config.json); "
                         "give a directory written by save_pretrained or a hub id like org/name")
    return str(Path(p).expanduser()) if looks_local else p


def load_sources(cfg: RunConfig, tokenizer):
    d = cfg.data
    if d.source.startswith("synthetic:"):
        from conveyor.data.synthetic import synthetic_source
        name = d.source.split(":", 1)[1]
        return (synthetic_source(name, "train", d.options, d.eval_size, d.seed),
                synthetic_source(name, "eval", d.options, d.eval_size, d.seed))
    from conveyor.data.files import load_file_source
    return load_file_source(d, tokenizer, "train"), load_file_source(d, tokenizer, "eval")


def build(cfg: RunConfig, run_dir: Path, path: str) -> Components:
    """Everything but the trainer and the engines, which start in ``run_local``."""
    from transformers import AutoTokenizer

    from conveyor.data.api import TaskCursor
    from conveyor.observe.metrics import MetricsLogger
    from conveyor.observe.progress import PhaseProgress
    from conveyor.observe.timers import PhaseTimer
    from conveyor.reward.api import load_reward
    from conveyor.reward.service import RewardService
    from conveyor.transport.buffer import TrajectoryBuffer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except OSError as e:
        raise SetupError(f"cannot load the tokenizer of model.path {path!r}: {str(e).splitlines()[0]}") from None
    train_src, eval_src = load_sources(cfg, tokenizer)
    spec = train_src.default_reward if cfg.reward.fn == "auto" else cfg.reward.fn
    rewards = RewardService(load_reward(spec, cfg.reward.kwargs), timeout_s=cfg.reward.timeout_s,
                            fallback=cfg.reward.fallback, workers=cfg.reward.workers)
    lc = cfg.loop
    return Components(
        cfg=cfg, run_dir=run_dir, tokenizer=tokenizer, rewards=rewards,
        train_source=train_src, eval_tasks=[eval_src[i] for i in range(len(eval_src))],
        cursor=TaskCursor(train_src, lc.batch_size, seed=lc.seed),
        logger=MetricsLogger(run_dir, tensorboard=cfg.observe.tensorboard, progress=cfg.observe.progress,
                             console=PhaseProgress(lc.steps, cfg.sft.steps, cfg.observe.log_every)),
        timer=PhaseTimer(), buffer=TrajectoryBuffer(lc.buffer_size or lc.batch_size * (lc.max_staleness + 1)),
        add_special_tokens=not cfg.data.chat_template and not cfg.data.source.startswith("synthetic:"),
    )


def start_rollouts(c: Components, path: str, start_step: int) -> None:
    from conveyor.launch import placement, roles
    from conveyor.producer import Producer
    try:
        c.placement = placement.plan(c.cfg)
    except placement.PlacementError as e:
        raise SetupError(str(e)) from None
    c.routes = placement.make_routes(c.cfg, c.placement, path, roles.mp_context())
    c.weights = c.routes.controller
    engines, outbox, context_limit = roles.start_engines(c.cfg, path, c.tokenizer, c.routes, c.placement,
                                                         c.run_dir)
    c.max_prompt_tokens = max(1, context_limit - 1)
    c.producer = Producer(c, engines, outbox, lambda seed: loop.sampling(c.cfg, seed=seed),
                          start_issued=start_step * c.cfg.loop.batch_size, version=start_step)
    c.producer.start()


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    return ckpts[-1] if ckpts else None


def run_local(cfg: RunConfig, run_dir: Path, resume: bool = False) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.profile_steps and not cfg.trainer.profile_dir:
        trainer = cfg.trainer.model_copy(update={"profile_dir": str(run_dir / "profile")})
        cfg = cfg.model_copy(update={"trainer": trainer})
    save_config(cfg, run_dir / "config.yaml")
    t0 = time.perf_counter()
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise SetupError(f"--resume {run_dir}: no checkpoints/step_* inside; nothing to resume")
    base = resolve_model_path(cfg, run_dir)
    warm = run_dir / "warmstart"
    # A resumed run rebuilds its RL starting point (and so its reference model) from warmstart/.
    start_path = str(warm) if ckpt is not None and (warm / "config.json").exists() else base
    c = build(cfg, run_dir, start_path)
    try:
        return _run(c, cfg, run_dir, base, start_path, ckpt, t0)
    except Exception as e:
        _blame_dead_engine(c, e)
        raise
    finally:
        c.close()


def _blame_dead_engine(c: Components, error: Exception) -> None:
    """A trainer call that fails because an engine died (a broken broadcast) reports the engine:
    the root cause, with its exit code and log, rather than the peer's symptom."""
    from conveyor.launch.procs import RoleError
    if c.producer is None:
        return
    deadline = time.monotonic() + 3.0  # a death is reaped a moment after the peer notices it
    while time.monotonic() < deadline:
        for h in c.producer.engines:
            try:
                h.check()
            except RoleError as dead:
                first = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise RoleError(f"{dead}\n(the run noticed it as: {first})") from error
        if not isinstance(error, RoleError):
            return
        time.sleep(0.1)


def _run(c: Components, cfg: RunConfig, run_dir: Path, base: str, start_path: str, ckpt, t0: float) -> dict:
    from conveyor.launch.roles import start_trainer
    summary: dict[str, Any] = {}
    start_step = 0
    if ckpt is not None:
        extra = _read_extra(ckpt)
        start_step, summary = int(extra["step"]), dict(extra.get("summary", {}))
    start_rollouts(c, start_path, start_step)
    if ckpt is None:
        _record(summary, loop.evaluate(c, 0), "initial")
        if cfg.sft.steps > 0:
            start_path = warm_start_phase(c, base)
        _record(summary, loop.evaluate(c, 0), "warmstart")
        c.logger.message(f"held-out reward: initial {summary['eval_reward_initial']:.3f}, "
                         f"after warm-start {summary['eval_reward_warmstart']:.3f}")
    c.trainer = start_trainer(cfg, start_path, c.tokenizer, c.routes, c.placement, run_dir)
    if ckpt is not None:
        extra = c.trainer.load_checkpoint(ckpt)
        c.cursor.load_state_dict(extra["cursor"])
        c.trainer.publish(start_step)
        c.logger.message(f"resumed from {ckpt} at step {start_step}")
    c.timer.lap()  # step 1's times must not include the evaluations and start-up before it
    t_rl = time.perf_counter()
    last = loop.rl_loop(c, start_step, summary)
    rl_seconds = time.perf_counter() - t_rl
    steps_done = c.trainer.step()
    final = loop.evaluate(c, steps_done)
    _record(summary, final, "final")
    summary.update({
        "steps": steps_done,
        "wall_seconds": time.perf_counter() - t0, "rl_seconds": rl_seconds,
        "trained_samples_per_second": (steps_done - start_step) * cfg.loop.batch_size * cfg.rollout.n
        / max(rl_seconds, 1e-9),
        "final_metrics": last, "run_dir": str(run_dir), "max_prompt_tokens": c.max_prompt_tokens,
    })
    if cfg.loop.checkpoint_every:
        c.checkpoint(steps_done, summary)
    c.trainer.export_hf(run_dir / "final")
    c.tokenizer.save_pretrained(run_dir / "final")
    from conveyor.observe.report import write_summary
    write_summary(run_dir, summary)
    if cfg.observe.progress:  # the table of held-out numbers, the run's layout, how to try the model
        from conveyor.observe.progress import summary_text
        c.logger.message(summary_text(summary, run_dir, c.eval_tasks[:1]))
    return summary


def _record(summary: dict, evaluation: dict, point: str) -> None:
    """eval_reward -> eval_reward_initial / _warmstart / _final (and every other eval metric)."""
    summary.update({f"{k}_{point}": v for k, v in evaluation.items()})


def _read_extra(ckpt: Path) -> dict:
    return json.loads((ckpt / "extra.json").read_text())


def warm_start_phase(c: Components, base: str) -> str:
    """SFT in this process with its own optimizer; the result is published to the engines
    and saved as ``warmstart/``, the RL trainer's starting point. Returns that path."""
    import random

    from conveyor.launch.roles import make_trainer
    from conveyor.sft import warm_start
    cfg, sc = c.cfg, c.cfg.sft
    sft_cfg = cfg.trainer.model_copy(update={"lr": sc.lr, "reference": False, "critic": False,
                                             "warmup_steps": 0, "lr_schedule": "constant",
                                             "ppo_epochs": 1, "mini_batches": 1, "profile_steps": []})
    sft_trainer = make_trainer(cfg.model_copy(update={"trainer": sft_cfg}), base, c.tokenizer)
    held: set[int] = set()
    check = None
    if sc.target_reward is not None:
        # The early-stop check uses training tasks kept out of the warm-start, never the eval split.
        rng = random.Random(f"sft-check-{cfg.loop.seed}")
        held = set(rng.sample(range(len(c.train_source)), min(sc.check_size, len(c.train_source) // 2)))
        check_tasks = [c.train_source[i] for i in sorted(held)]

        def check() -> bool:
            c.weights.publish(sft_trainer.named_weights(), 0)
            r = loop.eval_tasks(c, check_tasks, cfg.loop.eval_temperature, "sft_check_")
            c.logger.log(sft_trainer.step, r, kind="sft")
            return r["sft_check_reward"] >= sc.target_reward
    with c.timer.phase("warm_start"):
        steps = warm_start(sft_trainer, c.tokenizer, c.train_source, sc.steps, sc.batch_size, cfg.loop.seed,
                           c.add_special_tokens, check=check, check_every=sc.check_every, exclude=held,
                           log=lambda s, m: c.logger.log(s, m, kind="sft") if (s + 1) % 10 == 0 else None)
    c.logger.message(f"warm-start: {steps} supervised steps")
    warm = c.run_dir / "warmstart"
    sft_trainer.export_hf(warm)
    c.tokenizer.save_pretrained(warm)
    c.weights.publish(sft_trainer.named_weights(), 0)
    c.timer.lap()
    return str(warm)
