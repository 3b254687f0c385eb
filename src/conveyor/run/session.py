"""One training run from start to finish, over the role handles a launcher provides.

Contract: ``run(cfg, run_dir, resume, launcher)`` runs the whole run (initial evaluation,
warm start, RL, final evaluation, final checkpoint and ``summary.json``); with ``resume`` it
continues from the newest checkpoint. ``Session`` holds one run's parts, each typed;
``SetupError`` (``runtime.errors``) is a run that cannot start, with the fix in its message.
It knows which parts a config asks for, and nothing of where roles run or of the
formulas: the launcher it is given starts them (``run/local.py``,
``run/ray.py`` give it one).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from conveyor import loop
from conveyor.config import RunConfig, save_config
from conveyor.config.overlap import time_share_on
from conveyor.controller.group_filter import GroupFilter
from conveyor.controller.producer import Producer, Prompting
from conveyor.controller.schedule import Ledger, ResumePoint
from conveyor.controller.time_share import TimeShare
from conveyor.data.api import TaskCursor, TaskSource, prompt_special_tokens
from conveyor.launch.api import Launcher
from conveyor.launch.placement import plan
from conveyor.observe import timeline
from conveyor.observe.metrics import MetricsLogger
from conveyor.observe.progress import PhaseProgress
from conveyor.observe.timers import PhaseTimer
from conveyor.reward.api import RewardHandle
from conveyor.rollout.api import SamplingParams
from conveyor.run import checkpoints
from conveyor.run.evaluate import Evaluator
from conveyor.runtime.errors import SetupError
from conveyor.trainer import sm_share
from conveyor.trainer.api import TrainerHandle
from conveyor.trainer.checkpoint import reader_of
from conveyor.trainer.fit import check_micro_batches, needs_time_share, own_gpu_default
from conveyor.transport.buffer import TrajectoryBuffer


@dataclass
class RunClock:
    """When this part of the run started, and when its RL loop did (0 until then)."""
    started: float
    rl_started: float = 0.0


@dataclass
class Session:
    """One run's parts. The roles (``rollouts``, ``evaluator``, ``warm``, ``trainer``) are set
    as the launcher starts them."""
    cfg: RunConfig
    run_dir: Path
    launcher: Launcher
    tokenizer: Any
    rewards: RewardHandle
    train_source: TaskSource
    eval_tasks: list
    cursor: TaskCursor
    logger: MetricsLogger
    timer: PhaseTimer
    buffer: TrajectoryBuffer
    add_special_tokens: bool
    rollouts: Producer | None = None
    memory: TimeShare | None = None  # the engines' KV pools, when time-shared with the trainer
    evaluator: Evaluator | None = None
    warm: Any = None  # where warm-start weights are published (Engines.warm)
    trainer: TrainerHandle | None = None
    before: checkpoints.Totals = field(default_factory=checkpoints.Totals)  # a resumed run's earlier parts
    ledger: Ledger | None = None  # the places of the schedule trained so far (set as RL starts)
    clock: RunClock = field(default_factory=lambda: RunClock(time.perf_counter()))

    def checkpoint(self, step: int, summary: dict, counters: dict, evaluation: dict | None) -> Path:
        """Save ``step`` with the run's totals so far (``counters``: the running counts, already
        including earlier parts'), then keep only ``loop.keep_checkpoints`` (and the best)."""
        path = self.run_dir / "checkpoints" / f"step_{step:06d}"
        # With max_staleness > 0 groups are trained as they are scored: places of later steps
        # may be trained and earlier ones still in flight. A resume draws again from the step
        # boundary below the first place not trained and skips the places trained since
        # (controller.schedule), so the cursor is saved as of that boundary. The producer
        # records the state before it draws: if it has not recorded it after our read, our
        # read was before its draw.
        now = self.cursor.state_dict()
        point = self.ledger.resume_point()
        rl_s = time.perf_counter() - self.clock.rl_started - self.timer.outside_s if self.clock.rl_started else 0.0
        totals = self.before.since(time.perf_counter() - self.clock.started, rl_s, step, counters)
        extra = {"step": step, "cursor": self.rollouts.cursor_at(point.boundary, now),
                 "schedule": point.to_json(), "summary": summary,
                 "totals": totals.to_json(), "saved_at": time.time()}
        if evaluation and isinstance(evaluation.get("eval_reward"), (int, float)):
            extra["eval_reward"] = evaluation["eval_reward"]
        self.trainer.save_checkpoint(path, extra)
        if (path / "policy").is_dir():  # saved in the call: the tokenizer too (an asynchronous save copies
            self.tokenizer.save_pretrained(path / "policy")  # the trainer's own tokenizer files)
        checkpoints.prune(self.run_dir, self.cfg.loop.keep_checkpoints, self.cfg.loop.keep_best)
        return path

    def start_rollouts(self, path: str, start: ResumePoint | None = None, step: int = 0) -> None:
        """The engines and the producer: from ``start`` in the schedule (a resume's; None: the
        beginning), admitting for version ``step``."""
        engines = self.launcher.start_engines(path, self.tokenizer)
        self.warm = engines.warm
        cfg = self.cfg
        self.logger.message(f"rollouts: {engines.label}")
        if cfg.rollout.quantization != "none":
            self.logger.message(f"rollout.quantization={cfg.rollout.quantization}: algo.importance_sampling="
                                f"{cfg.algo.importance_sampling} (is_cap={cfg.algo.is_cap}; truncated unless set)")
        prompting = Prompting(self.tokenizer, max(1, engines.context_limit - 1), self.add_special_tokens)
        runner = None
        if cfg.env.name:
            from conveyor.episodes.runner import episode_runner
            runner = episode_runner(cfg, engines.workers, self.tokenizer, engines.context_limit,
                                    lambda: self.rollouts.version(), self.add_special_tokens)
        self.rollouts = Producer(engines.workers, engines.outbox, loop=cfg.loop, timeout_s=cfg.launch.timeout_s,
                                 prompting=prompting, cursor=self.cursor, train_size=len(self.train_source),
                                 rewards=self.rewards, buffer=self.buffer,
                                 start=start, version=step,
                                 sampling=lambda seed: SamplingParams.from_config(cfg.rollout, seed=seed),
                                 episodes=runner, max_failed_groups=cfg.env.max_failed_groups,
                                 restarts=engines.restarts, group_filter=GroupFilter.from_config(cfg))
        self.rollouts.start()
        if time_share_on(cfg, "cuda" if cfg.launch.backend == "local" and plan(cfg).gpu else "cpu"):
            self.memory = self.rollouts.time_share  # with auto, kept only if the trainer needs it (_run)
        self.evaluator = Evaluator(cfg, self.eval_tasks, prompting, self.rollouts, self.rewards, self.logger,
                                   episodes=runner)

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.stop()
            self.launcher.stop_engines(list(self.rollouts.workers))
        if self.trainer is not None:
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
                       t.intermediate_size, t.max_position_embeddings, seed=cfg.loop.seed,
                       num_experts=t.num_experts, experts_per_token=t.experts_per_token,
                       moe_intermediate_size=t.moe_intermediate_size)
        return str(out)
    p = cfg.model.path
    from conveyor.data.gguf import GGUFError, is_gguf_spec, resolve_gguf
    if is_gguf_spec(p):
        try:
            return str(resolve_gguf(p))
        except GGUFError as e:
            raise SetupError(str(e)) from None
    looks_local = p.startswith((".", "/", "~")) or Path(p).exists() or p.count("/") != 1
    if looks_local and not (Path(p).expanduser() / "config.json").exists():
        raise SetupError(f"model.path {p!r} is not a Hugging Face checkpoint directory (no config.json); "
                         "give a directory written by save_pretrained, a .gguf file, pkg:<package> or a hub id like org/name")
    return str(Path(p).expanduser()) if looks_local else p


def _check_moe(path: str) -> None:
    from transformers import AutoConfig

    from conveyor.routing import config_moe_shape
    if config_moe_shape(AutoConfig.from_pretrained(path)) is None:
        raise SetupError(f"algo.routing_replay needs a mixture-of-experts model, and model.path {path!r} is dense; "
                         "set algo.routing_replay=false")


def load_sources(cfg: RunConfig, tokenizer):
    d = cfg.data
    if d.source.startswith("synthetic:"):
        from conveyor.data.files import chat_prompt
        from conveyor.data.synthetic import synthetic_source
        name = d.source.split(":", 1)[1]
        render = None
        if d.prompt_template != "{prompt}" or d.chat_template:
            def render(prompt: str, parts: dict) -> str:
                try:
                    text = d.prompt_template.format(prompt=prompt, **parts)
                except (KeyError, IndexError) as e:
                    raise SetupError(f"data.prompt_template names {e} which task {name!r} does not have; "
                                     f"its fields: prompt, {', '.join(parts) or '(none else)'}") from None
                return chat_prompt(d, tokenizer, text)
        return tuple(synthetic_source(name, s, d.options, d.eval_size, d.seed, render=render)
                     for s in ("train", "eval"))
    if d.source.startswith("reasoning_gym:"):
        from conveyor.data.files import chat_prompt
        from conveyor.data.reasoning_gym import reasoning_gym_source
        name = d.source.split(":", 1)[1]

        def render(question: str) -> str:
            return chat_prompt(d, tokenizer, d.prompt_template.format(prompt=question))
        return tuple(reasoning_gym_source(name, s, d.options, d.eval_size, d.seed, render) for s in ("train", "eval"))
    if d.source.startswith("textarena:"):
        from conveyor.env.ecosystem import textarena_source
        if not cfg.env.name:  # the game's first observation is the prompt: only an environment gives it
            raise SetupError(f"data.source={d.source!r} needs env.name=textarena (its tasks are games to play)")
        name = d.source.split(":", 1)[1]
        return tuple(textarena_source(name, s, d.options, d.eval_size, d.seed) for s in ("train", "eval"))
    from conveyor.data.files import load_file_source
    return load_file_source(d, tokenizer, "train"), load_file_source(d, tokenizer, "eval")


def build(cfg: RunConfig, run_dir: Path, path: str, launcher: Launcher, purge_step: int | None = None) -> Session:
    """Everything but the roles, which the launcher starts."""
    from transformers import AutoTokenizer

    from conveyor import staleness
    from conveyor.reward.factory import reward_service, reward_spec

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except OSError as e:
        raise SetupError(f"cannot load the tokenizer of model.path {path!r}: {str(e).splitlines()[0]}") from None
    from conveyor.data.files import check_tokenizer
    try:
        check_tokenizer(tokenizer, f"model.path {cfg.model.path or path}", chat=cfg.data.chat_template)
    except ValueError as e:
        raise SetupError(str(e)) from None
    train_src, eval_src = load_sources(cfg, tokenizer)
    # With an environment its own reward is the default; otherwise the task source's verifier.
    spec = reward_spec(cfg.reward, "env" if cfg.env.name else train_src.default_reward)
    # Threads or worker processes (reward.executor); a reward model or judge is built here, once
    # (a reward model under executor=process: by each worker process, from its spec).
    if spec.fn == "rm" and cfg.reward.executor in ("process", "ray"):
        spec = reward_model_spec(cfg)
    reward = reward_model(cfg) if spec.fn == "rm" else judge(cfg, run_dir) if spec.fn == "judge" else None
    if cfg.reward.executor == "ray":  # worker processes as Ray actors: the Ray launcher places them
        from conveyor.launch.ray_rewards import ray_reward_service
        rewards = ray_reward_service(cfg.reward, spec, cfg.launch)
    else:
        rewards = reward_service(cfg.reward, spec, reward, cfg.launch)
    lc = cfg.loop
    return Session(
        cfg=cfg, run_dir=run_dir, launcher=launcher, tokenizer=tokenizer, rewards=rewards,
        train_source=train_src, eval_tasks=[eval_src[i] for i in range(len(eval_src))],
        cursor=TaskCursor(train_src, lc.batch_size, seed=lc.seed),
        logger=MetricsLogger(run_dir, tensorboard=cfg.observe.tensorboard, progress=cfg.observe.progress,
                             console=PhaseProgress(lc.steps, cfg.sft.steps, cfg.observe.log_every),
                             traces_per_step=cfg.observe.traces_per_step, traces_max_mb=cfg.observe.traces_max_mb,
                             tokenizer=tokenizer, seed=lc.seed, sinks=cfg.observe.sinks, project=cfg.observe.project,
                             timeline=cfg.observe.timeline, config=cfg.model_dump(mode="json"),
                             eval_samples=cfg.observe.eval_samples, purge_step=purge_step),
        timer=PhaseTimer(on_span=timeline.phase_span),  # the loop's phases are the controller's timeline row
        buffer=TrajectoryBuffer(lc.buffer_size or staleness.capacity(lc.batch_size, lc.max_staleness)),
        add_special_tokens=prompt_special_tokens(cfg.data),
    )


def reward_model(cfg: RunConfig):
    """``reward.fn: rm``: the reward model on its device (``placement.reward_device``), loaded and
    checked before anything else starts."""
    from conveyor.launch.placement import reward_device
    from conveyor.reward.model import RewardModel, RewardModelError
    try:
        return RewardModel(cfg.reward.model, device=reward_device(cfg), max_batch=cfg.reward.max_batch,
                           normalize=cfg.reward.normalize)
    except RewardModelError as e:
        raise SetupError(str(e)) from None


def reward_model_spec(cfg: RunConfig):
    """``reward.fn: rm`` under ``reward.executor: process``: the checkpoint checked here, before
    anything starts; each worker process builds the model from the returned spec."""
    from conveyor.launch.placement import reward_device
    from conveyor.reward.factory import model_spec
    from conveyor.reward.model import RewardModelError, check_checkpoint
    try:
        check_checkpoint(cfg.reward.model)
    except RewardModelError as e:
        raise SetupError(str(e)) from None
    return model_spec(cfg.reward, reward_device(cfg))


def judge(cfg: RunConfig, run_dir: Path):
    """``reward.fn: judge``: the generative judge's engine, loaded and checked before anything else
    starts; without ``reward.judge.model`` it is the policy's base checkpoint."""
    from conveyor.run.judge_setup import JudgeSetupError, build_judge
    try:
        return build_judge(cfg, resolve_model_path(cfg, run_dir))
    except JudgeSetupError as e:
        raise SetupError(str(e)) from None


def check_lora(cfg: RunConfig, path: str) -> None:
    """``trainer.lora`` targets that the model lacks stop the run before anything starts."""
    from conveyor.trainer.lora import LoraSetupError, check_checkpoint
    try:
        check_checkpoint(path, cfg.trainer.lora, cfg.model.trust_remote_code)
    except LoraSetupError as e:
        raise SetupError(str(e)) from None


def latest_checkpoint(run_dir: Path) -> Path | None:
    return checkpoints.latest(run_dir)


def run(cfg: RunConfig, run_dir: Path, resume: bool, launcher: Callable[[RunConfig, Path], Launcher]) -> dict:
    """Contract: ``run(cfg, run_dir, resume, launcher)`` saves the resolved config,
    builds the controller's parts (tokenizer, task sources, reward service,
    cursor, buffer, metrics), has the ``launcher(cfg, run_dir)`` it builds
    start the engines, evaluates the
    initial policy, runs the supervised warm start when ``sft.steps > 0`` (its
    result saved as ``run_dir/warmstart``, so a resumed run rebuilds the same RL
    starting point and reference model), has the launcher start the trainer,
    runs ``loop.rl_loop``, evaluates again and writes a final HF checkpoint and
    ``summary.json``. With ``resume`` it restores the newest
    ``run_dir/checkpoints/step_N`` (weights, optimizer, RNG, data cursor) and
    continues. ``Session`` holds one run's parts, each typed; ``SetupError``
    (``runtime.errors``) is a run that cannot start, with the fix in its message.
    The reward service is ``reward.factory.reward_service``'s, or with
    ``reward.executor=ray`` the Ray launcher's (``launch.ray_rewards``).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.trainer.profile_steps and not cfg.trainer.profile_dir:
        trainer = cfg.trainer.model_copy(update={"profile_dir": str(run_dir / "profile")})
        cfg = cfg.model_copy(update={"trainer": trainer})
    save_config(cfg, run_dir / "config.yaml")
    from conveyor.runtime import watchdog
    watchdog.configure(run_dir / "logs")  # where a wait that runs out writes the controller's stacks
    t0 = time.perf_counter()
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise SetupError(f"--resume {run_dir}: no checkpoints/step_* inside; nothing to resume")
    if ckpt is not None and cfg.trainer.parallel == "auto":
        # Trainer ranks read their own kind's checkpoints: sharded ones FSDP ranks wrote, or whole ones.
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"parallel": reader_of(ckpt)})})
    base = resolve_model_path(cfg, run_dir)
    check_lora(cfg, base)
    if cfg.algo.routing_replay:
        _check_moe(base)
    warm = run_dir / "warmstart"
    # A resumed run rebuilds its RL starting point (and so its reference model) from warmstart/.
    start_path = str(warm) if ckpt is not None and (warm / "config.json").exists() else base
    before, resume_step = checkpoints.Totals(), None
    if ckpt is not None:  # the logs lose what the resumed run writes again: they read as one run
        extra = checkpoints.read_extra(ckpt)
        resume_step = int(extra["step"])
        lost_s = checkpoints.rewind(run_dir, resume_step).lost_seconds(extra.get("saved_at"))
        before = checkpoints.Totals.of(extra)
        before.wall_seconds += lost_s  # the time spent past the checkpoint was spent too
    s = build(cfg, run_dir, start_path, launcher(cfg, run_dir), purge_step=resume_step)
    s.before, s.clock = before, RunClock(t0)
    try:
        return _run(s, base, start_path, ckpt, t0)
    except Exception as e:
        _blame_dead_engine(s, e)
        raise
    finally:
        s.close()


def _blame_dead_engine(s: Session, error: Exception) -> None:
    """A trainer call that fails because an engine died (a broken broadcast) reports the engine:
    the root cause, with its exit code and log, rather than the peer's symptom."""
    from conveyor.runtime.errors import RoleError
    if s.rollouts is None:
        return
    deadline = time.monotonic() + 3.0  # a death is reaped a moment after the peer notices it
    while time.monotonic() < deadline:
        for w in s.rollouts.workers:
            try:
                w.check()
            except RoleError as dead:
                if str(dead).splitlines()[0] in str(error):  # the error already names the death:
                    cause = error.__cause__  # the producer's own (a closed buffer only passes it on)
                    if isinstance(cause, RoleError) and str(dead).splitlines()[0] in str(cause):
                        raise cause from None
                    return
                first = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise RoleError(f"{dead}\n(the run noticed it as: {first})") from error
        if not isinstance(error, RoleError):
            return
        time.sleep(0.1)


def _run(s: Session, base: str, start_path: str, ckpt: Path | None, t0: float) -> dict:
    cfg, run_dir = s.cfg, s.run_dir
    summary: dict[str, Any] = {}
    start_step, bs = 0, cfg.loop.batch_size
    point = ResumePoint(0, bs)
    if ckpt is not None:
        extra = json.loads((ckpt / "extra.json").read_text())
        start_step, summary = int(extra["step"]), dict(extra.get("summary", {}))
        point = ResumePoint.from_json(extra.get("schedule"), start_step, bs)
    if cfg.loop.accumulate_sms:  # refused before the run starts, not at the first step's first part
        sm_share.check(cfg.loop.accumulate_sms)
    s.start_rollouts(start_path, point, start_step)
    if ckpt is None:
        _record(summary, s.evaluator.evaluate(0), "initial")
        if cfg.sft.steps > 0:  # without a warm-start the model is the one just evaluated
            start_path = warm_start_phase(s, base)
            _record(summary, s.evaluator.evaluate(0), "warmstart")
            s.logger.message(f"held-out reward: initial {summary['eval_reward_initial']:.3f}, "
                             f"after warm-start {summary['eval_reward_warmstart']:.3f}")
    def engines_failed() -> BaseException | None:  # stops the trainer's start, then a call that waits on them
        return s.rollouts.error
    s.trainer = s.launcher.start_trainer(start_path, s.tokenizer, failed=engines_failed)
    s.trainer.stop_if(engines_failed)
    s.logger.message(f"trainer: {s.trainer.describe()}")
    length = s.evaluator.prompting.max_prompt_tokens + cfg.rollout.max_new_tokens
    if s.memory is not None:
        if cfg.launch.time_share == "auto" and not needs_time_share(s.trainer, cfg, length):
            s.memory = None
            s.logger.message(f"launch.time_share=auto: trainer.micro_batch_tokens={cfg.trainer.micro_batch_tokens} "
                             "fits beside the engines' KV pools, which stay held (on: released every step)")
        else:
            s.logger.message("launch.time_share: the engines' KV pools are released while the trainer trains")
    # The memory these budgets get: refused (or a default halved) now, not out of memory mid-run.
    if s.memory is not None or cfg.loop.accumulate_groups or "micro_batch_tokens" not in cfg.trainer.model_fields_set:
        own = own_gpu_default(cfg, s.launcher.trainer_gpus_alone())
        notes = check_micro_batches(s.trainer, cfg, length, s.memory, own)
        for note in notes:
            s.logger.message(note)
        if notes:  # a resume starts from the budget that fit
            save_config(cfg, run_dir / "config.yaml")
    if ckpt is not None:
        extra = s.trainer.load_checkpoint(ckpt)
        s.cursor.load_state_dict(extra["cursor"])
        s.trainer.publish(start_step)
        s.logger.message(f"resumed from {ckpt} at step {start_step}")
    s.ledger = Ledger.resumed(point)
    s.timer.lap()  # step 1's times must not include the evaluations and start-up before it
    t_rl = s.clock.rl_started = time.perf_counter()
    last = loop.rl_loop(cfg, trainer=s.trainer, rollouts=s.rollouts, buffer=s.buffer, rewards=s.rewards,
                        logger=s.logger, timer=s.timer, evaluate=s.evaluator.evaluate,
                        checkpoint=lambda step, counters, evaluation: s.checkpoint(step, summary, counters, evaluation),
                        start_step=start_step, ledger=s.ledger, counted_before=s.before.offset, memory=s.memory)
    # Training time (mid-run evaluations left out) and wall time of the whole run, resumed parts included.
    rl_seconds = s.before.rl_seconds + time.perf_counter() - t_rl - s.timer.outside_s
    steps_done = s.trainer.step()
    _record(summary, s.evaluator.evaluate(steps_done), "final")
    summary.update({
        "steps": steps_done,
        "wall_seconds": s.before.wall_seconds + time.perf_counter() - t0, "rl_seconds": rl_seconds,
        "trained_samples_per_second": steps_done * cfg.loop.batch_size * cfg.rollout.n / max(rl_seconds, 1e-9),
        "resumed_from": start_step if ckpt is not None else None,
        "final_metrics": last, "run_dir": str(run_dir), "max_prompt_tokens": s.evaluator.prompting.max_prompt_tokens,
        "traces_skipped": s.logger.tracer.skipped if s.logger.tracer else 0,
    })
    if cfg.loop.checkpoint_every:
        s.checkpoint(steps_done, summary, s.before.offset(loop.running_counts(s.rewards, s.rollouts.snapshot())),
                     None)
    s.trainer.export_hf(run_dir / "final")
    s.tokenizer.save_pretrained(run_dir / "final")
    from conveyor.observe.report import write_summary
    write_summary(run_dir, summary)
    s.logger.summary(summary)  # to the trackers of observe.sinks (W&B, MLflow)
    if cfg.observe.progress:  # the table of held-out numbers, the run's layout, how to try the model
        from conveyor.observe.progress import summary_text
        s.logger.message(summary_text(summary, run_dir, s.eval_tasks[:1]))
    return summary


def _record(summary: dict, evaluation: dict, point: str) -> None:
    """eval_reward -> eval_reward_initial / _warmstart / _final (and every other eval metric)."""
    summary.update({f"{k}_{point}": v for k, v in evaluation.items()})


def warm_start_phase(s: Session, base: str) -> str:
    """SFT in this process with its own optimizer; the result is published to the engines
    and saved as ``warmstart/``, the RL trainer's starting point. Returns that path."""
    import random

    from conveyor.run.sft import warm_start
    cfg, sc = s.cfg, s.cfg.sft
    sft_cfg = cfg.trainer.model_copy(update={"lr": sc.lr, "reference": False, "critic": False,
                                             "warmup_steps": 0, "lr_schedule": "constant",
                                             "ppo_epochs": 1, "mini_batches": 1, "profile_steps": [],
                                             "lora": cfg.trainer.lora.model_copy(update={"enabled": False})})
    # trainer.lora is for RL: the warm start trains every weight, the RL trainer's adapters sit on its result.
    sft_trainer = s.launcher.warm_start_trainer(cfg.model_copy(update={"trainer": sft_cfg}), base, s.tokenizer)
    held: set[int] = set()
    check = None
    if sc.target_reward is not None:
        # The early-stop check uses training tasks kept out of the warm-start, never the eval split.
        rng = random.Random(f"sft-check-{cfg.loop.seed}")
        held = set(rng.sample(range(len(s.train_source)), min(sc.check_size, len(s.train_source) // 2)))
        check_tasks = [s.train_source[i] for i in sorted(held)]

        def check() -> bool:
            s.warm.publish(sft_trainer.named_weights(), 0)
            r = s.evaluator.on(check_tasks, cfg.loop.eval_temperature, "sft_check_")
            s.logger.log(sft_trainer.step, r, kind="sft")
            return r["sft_check_reward"] >= sc.target_reward
    with s.timer.phase("warm_start"):
        steps = warm_start(sft_trainer, _demonstrations(s), s.train_source, sc.steps, sc.batch_size,
                           cfg.loop.seed, check=check, check_every=sc.check_every, exclude=held,
                           log=lambda step, m: s.logger.log(step, m, kind="sft") if (step + 1) % 10 == 0 else None)
    s.logger.message(f"warm-start: {steps} supervised steps")
    warm = s.run_dir / "warmstart"
    sft_trainer.export_hf(warm)
    s.tokenizer.save_pretrained(warm)
    s.warm.publish(sft_trainer.named_weights(), 0)
    s.timer.lap()
    return str(warm)


def _demonstrations(s: Session):
    """How the warm start builds a batch: the source's demonstrations, or (``env.name``)
    episodes its scripted teacher plays in the environment, loss on the teacher's turns."""
    from conveyor.run.sft import demonstration_batches
    runner = s.rollouts.episodes
    if runner is None:
        return demonstration_batches(s.tokenizer, s.train_source, s.add_special_tokens)
    teacher = getattr(s.train_source, "teacher", None)  # declared by multi-turn task sources only
    if teacher is None:
        raise SetupError(f"sft.steps={s.cfg.sft.steps} with env.name={s.cfg.env.name!r}: the task source "
                         f"{s.cfg.data.source!r} has no scripted teacher to demonstrate episodes; set sft.steps=0")
    from conveyor.controller.objective import base_batch

    def batch_of(tasks, rng):
        trajs = runner.demonstrate(tasks, teacher, rng, timeout_s=s.cfg.launch.timeout_s)
        if not trajs:
            raise SetupError("warm start: every demonstration episode failed; see the log for the environment's error")
        return base_batch(trajs)
    return batch_of
