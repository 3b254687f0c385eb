"""The Python API beside the CLI: load a recipe, train, try the model, evaluate it.

- ``load_config(recipe=None, overrides=())``: the recipe with its overrides; a ``ConfigError``
  names a bad field.
- ``train(cfg, run_dir=None, resume=False) -> TrainSummary``: the whole run, devices checked
  before anything starts.
- ``generate(run_dir, prompts, ...)``, ``evaluate(run_dir, ...) -> EvalResult``: the run's model
  tried and evaluated; ``model_dir`` / ``export``: where it is, and as a plain HF directory.

It knows the run directory's layout and nothing of the loop's internals.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import Any

from conveyor.config import ConfigError, RunConfig, recipe_without_file
from conveyor.config import load_config as _load

PHASES = ("initial", "warmstart", "final")


@dataclass(frozen=True)
class EvalResult:
    """Held-out numbers of one model: mean reward greedy and sampled, and the exact-answer rate
    (the reward's ``exact`` metric when it reports one; None otherwise or when not evaluated)."""
    greedy_reward: float | None
    sampled_reward: float | None = None
    exact: float | None = None
    sampled_exact: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_metrics(cls, m: dict[str, Any], suffix: str = "") -> EvalResult:
        def get(key: str) -> float | None:
            v = m.get(key + suffix)
            return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
        own = {k[:len(k) - len(suffix)] if suffix else k: v for k, v in m.items()
               if k.startswith("eval_") and (not suffix or k.endswith(suffix))}
        return cls(get("eval_reward"), get("eval_sampled_reward"), get("eval_exact"),
                   get("eval_sampled_exact"), own)


@dataclass(frozen=True)
class TrainSummary:
    """What a finished run reports; ``raw`` is the run's ``summary.json`` as a dict."""
    run_dir: Path
    model_dir: Path
    steps: int
    wall_seconds: float
    initial: EvalResult
    warmstart: EvalResult
    final: EvalResult
    raw: dict[str, Any]


def load_config(recipe: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The recipe (None: the built-in one, or the pretrained-model recipe when the overrides name
    ``model.path``) with the dotted overrides applied.

    ``load_config(recipe=None, overrides=())``: the built-in default recipe when
    ``recipe`` is None (as ``conveyor train`` with no recipe), else the file (its
    ``base:`` chain merged under it), then the dotted overrides; a ``ConfigError``
    names a bad field.
    """
    return _load(recipe if recipe is not None else recipe_without_file(list(overrides)), list(overrides))


def default_run_dir(cfg: RunConfig) -> Path:
    import datetime as _dt
    if cfg.output_dir:
        return Path(cfg.output_dir)
    return Path("runs") / f"{cfg.name}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


# Sections ("x.") or single fields. What a resume cannot change: the weights come from the
# checkpoint, the warm start is done.
RESUME_FIXED = ("model.", "sft.")
# What makes a resume another run (what it learns from, how it scores and updates): refused
# unless allow_changes, and then recorded in run_dir/config_changes.jsonl.
RESUME_GUARDED = ("data.", "algo.", "reward.", "env.", "rollout.n", "rollout.temperature", "rollout.top_p",
                  "rollout.top_k", "rollout.max_new_tokens", "seed")


def check_resume(cfg: RunConfig, run_dir: str | Path, allow_changes: bool = False) -> list[tuple[str, Any, Any]]:
    """The fields ``cfg`` changes from the run's saved config.yaml; a ``ConfigError`` naming them when
    they change the model or the warm start (never allowed) or, without ``allow_changes``, the data,
    the rewards, the environment, the sampling or the algorithm. Allowed changes are appended to
    ``run_dir/config_changes.jsonl`` (config.yaml then says what trains from here on)."""
    import json
    import time

    import yaml

    from conveyor.config import config_diff, validate
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; give a run directory written by conveyor train")
    saved = validate(yaml.safe_load(path.read_text()))
    changes = [(k, old, new) for k, old, new in config_diff(cfg, saved) if not k.startswith("trainer.profile_dir")]

    def named(prefixes: tuple[str, ...]) -> list[str]:
        return [f"{k} ({old!r} -> {new!r})" for k, old, new in changes
                if any(k.startswith(p) if p.endswith(".") else k == p for p in prefixes)]
    fixed, guarded = named(RESUME_FIXED), named(RESUME_GUARDED)
    if fixed:
        raise ConfigError(f"--resume {run_dir}: {', '.join(fixed)} cannot change in a resumed run (its weights "
                          "are the checkpoint's); start a new run, e.g. with model.path=<the checkpoint>")
    if guarded and not allow_changes:
        raise ConfigError(f"--resume {run_dir}: {', '.join(guarded)} would make it another run; drop the "
                          "override, or pass --allow-changes (recorded in config_changes.jsonl)")
    if changes:
        record = {"time": time.time(), "changes": {k: {"from": old, "to": new} for k, old, new in changes}}
        with (Path(run_dir) / "config_changes.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
    return changes


def _refuse_a_used_dir(run_dir: Path) -> None:
    """A run writes into a directory no other run trained in: appended to, its logs would read as
    one run of two, and its export would meet the other's files."""
    held = [name for name in ("summary.json", "metrics.jsonl", "checkpoints", "final")
            if (run_dir / name).exists() and not (name == "metrics.jsonl" and (run_dir / name).stat().st_size == 0)]
    if held:
        raise ConfigError(f"--output-dir {run_dir} holds another run ({', '.join(held)}); give a new directory, "
                          f"or --resume {run_dir} to continue that one")


def train(cfg: RunConfig, run_dir: str | Path | None = None, resume: bool = False,
          allow_changes: bool = False) -> TrainSummary:
    """Train ``cfg`` in ``run_dir``; ``resume``: continue it from its latest checkpoint, with the
    changes ``check_resume`` allows (``allow_changes``: those to the data, rewards, environment,
    sampling and algorithm too).

    ``train(cfg, run_dir=None, resume=False) -> TrainSummary``: checks devices
    before anything starts (``launch.preflight``), runs the whole run (initial
    eval, warm-start, RL, final eval, ``final/``) and returns its typed summary.
    """
    from conveyor.launch.preflight import check_devices
    from conveyor.observe.progress import quiet_libraries, say
    if cfg.launch.backend == "ray":  # the cluster's devices, not this machine's, are the roles'
        try:
            from conveyor.run.ray import run_ray as run_roles
        except ModuleNotFoundError as e:
            if e.name != "ray":
                raise
            raise ConfigError("launch.backend=ray needs Ray on this machine: pip install 'conveyor[ray]'") from None
    else:
        from conveyor.run.local import run_local as run_roles
        check_devices(cfg)
    quiet_libraries()
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    if resume:
        changes = check_resume(cfg, run_dir, allow_changes)
        if changes:
            say(f"resume changes: {', '.join(f'{k}={new!r}' for k, _, new in changes)}")
    else:
        _refuse_a_used_dir(run_dir)
    if cfg.sft.steps == 0 and not resume:
        if cfg.model.path:
            say(f"warm-start: skipped (sft.steps is 0); RL starts from {cfg.model.path} as it is")
        else:
            say("warm-start: skipped (sft.steps is 0); RL starts from the untrained tiny model. "
                "Set sft.steps=N to teach the answer format first")
    raw = run_roles(cfg, run_dir, resume=resume)
    return summary_of(raw, run_dir)


def summary_of(raw: dict[str, Any], run_dir: Path) -> TrainSummary:
    return TrainSummary(run_dir=run_dir, model_dir=run_dir / "final", steps=int(raw.get("steps", 0)),
                        wall_seconds=float(raw.get("wall_seconds", 0.0)),
                        **{p: EvalResult.from_metrics(raw, f"_{p}") for p in PHASES}, raw=raw)


def run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    import yaml
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml there; give a run directory written by conveyor train")
    return _load(None, list(overrides), base=yaml.safe_load(path.read_text()))


def model_dir(run_dir: str | Path, checkpoint: str | Path | None = None) -> Path:
    """Where the run's model is: ``final/`` (a plain HF directory), or the given checkpoint's
    directory (a path, a step number, or ``latest``), which may be sharded (see ``export``)."""
    from conveyor.run.session import latest_checkpoint
    run_dir = Path(run_dir)
    if checkpoint is not None:
        return checkpoint_dir(run_dir, checkpoint)
    if (run_dir / "final" / "config.json").is_file():
        return run_dir / "final"
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ConfigError(f"{run_dir}: no final/ model and no checkpoints/step_*; "
                          "give the directory of a finished run (conveyor train --output-dir)")
    return ckpt


def checkpoint_dir(run_dir: Path, checkpoint: str | Path) -> Path:
    from conveyor.run.session import latest_checkpoint
    text = str(checkpoint)
    if text == "latest":
        ckpt = latest_checkpoint(run_dir)
    elif text.isdigit():
        ckpt = run_dir / "checkpoints" / f"step_{int(text):06d}"
    else:
        ckpt = Path(text) if Path(text).is_dir() else run_dir / text
    if ckpt is None or not (ckpt / "policy").is_dir():
        have = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
        raise ConfigError(f"--checkpoint {checkpoint}: no checkpoint there; {run_dir} has "
                          f"{', '.join(have) or 'no checkpoints'} (give a step number, a path or latest)")
    return ckpt


def _lora_of(run_dir: str | Path):
    """The run's ``trainer.lora`` section, read alone from its config.yaml (off without one), so that
    exporting does not depend on the rest of an older run's config still validating."""
    import yaml

    from conveyor.config.lora import LoraConfig
    path = Path(run_dir) / "config.yaml"
    saved = yaml.safe_load(path.read_text()) if path.is_file() else None
    section = ((saved or {}).get("trainer") or {}).get("lora") or {}
    return LoraConfig.model_validate(section)


def export(run_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None,
           form: str = "merged") -> Path:
    """Write the run's model (``final/`` or a checkpoint, sharded FSDP ones included) to ``out``
    as a plain Hugging Face directory with the tokenizer; returns where it came from. A LoRA run
    (``trainer.lora``) exports merged weights, or with ``form="adapter"`` the adapter alone in
    peft's format (docs/lora.md).

    ``model_dir(run_dir, checkpoint=None)``: where a run's model is (``final/``,
    or a checkpoint directory); ``export(run_dir, out, checkpoint=None, form)`` writes
    it as a plain HF directory, from any of them (sharded FSDP checkpoints too);
    a LoRA run's ``form="adapter"`` writes its adapter alone (peft's format).
    """
    import shutil
    import warnings

    from conveyor.trainer.checkpoint import export_hf
    src, out = model_dir(run_dir, checkpoint), Path(out)
    if out.exists():
        raise ConfigError(f"{out} already exists; give a new directory to export to")
    lo = _lora_of(run_dir)
    if form not in ("merged", "adapter") or (form == "adapter" and not lo.enabled):
        raise ConfigError(f"--form {form}: {run_dir} has no LoRA adapter (trainer.lora.enabled is false); "
                          "export the whole model with --form merged" if form == "adapter" else
                          f"--form {form}: use merged or adapter")
    if lo.enabled and (src / "policy").is_dir():  # peft's names in the checkpoint: merge or extract
        from conveyor.trainer.lora import export_checkpoint
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            export_checkpoint(src, out, lo, form)
    elif form == "adapter":
        shutil.copytree(src / "adapter", out)  # final/ keeps the adapter beside the merged weights
    elif (src / "policy").is_dir():  # a checkpoint: policy/ (or, sharded, dcp/ + policy/'s config)
        with warnings.catch_warnings():  # dcp's single-process read warns that no process group exists
            warnings.simplefilter("ignore", UserWarning)
            export_hf(src, out)
    else:
        shutil.copytree(src, out)
    return src


@contextlib.contextmanager
def _plain_model(run_dir: str | Path, checkpoint: str | Path | None) -> Iterator[Path]:
    """A plain HF directory of the run's model for the length of the block (a sharded checkpoint
    or a LoRA run's checkpoint is exported into a temporary directory)."""
    import tempfile

    from conveyor.trainer.checkpoint import SHARDED_MARKER
    src = model_dir(run_dir, checkpoint)
    adapted = _lora_of(run_dir).enabled and (src / "policy").is_dir()  # peft's names: merged first
    if not (src / SHARDED_MARKER).is_file() and not adapted:
        yield src / "policy" if (src / "policy").is_dir() else src
        return
    with tempfile.TemporaryDirectory(prefix="conveyor-model-") as tmp:
        export(run_dir, Path(tmp) / "model", checkpoint)
        yield Path(tmp) / "model"


def _engine(cfg: RunConfig, path: Path):
    from transformers import AutoTokenizer

    from conveyor.rollout.factory import make_engine
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=cfg.model.trust_remote_code)
    rollout = cfg.rollout.model_copy(update={"engine": "native"}) if cfg.rollout.engine == "remote" else cfg.rollout
    return make_engine(rollout, str(path), tok), tok


def format_prompt(cfg: RunConfig, tokenizer, text: str) -> str:
    """The run's prompt formatting (data.prompt_template, chat template, system prompt) for a new prompt."""
    d = cfg.data
    parts: dict[str, str] = {}
    if d.source.startswith("synthetic:"):
        if d.prompt_template == "{prompt}" and not d.chat_template:
            return text
        from conveyor.data.synthetic import fields
        try:  # a templated synthetic task is given as the task's own prompt ("47+38=")
            parts = fields(d.source.split(":", 1)[1], text)
        except (ValueError, IndexError):
            raise ConfigError(f"prompt {text!r} is not a task of {d.source} (like the run's own prompts, e.g. "
                              "47+38=); pass --raw and the whole prompt text") from None
    try:
        text = d.prompt_template.format_map({"prompt": text, **parts})
    except (KeyError, IndexError) as e:
        raise ConfigError(f"data.prompt_template names {e} besides {{prompt}}; pass --raw and the whole "
                          "prompt text") from None
    from conveyor.data.files import chat_prompt
    return chat_prompt(d, tokenizer, text)


def generate(run_dir: str | Path, prompts: Sequence[str], *, checkpoint: str | Path | None = None,
             temperature: float = 0.0, max_new_tokens: int | None = None, raw: bool = False,
             seed: int = 0) -> list[str]:
    """Completions of the run's model for ``prompts`` (greedy unless ``temperature`` > 0). A run
    with an environment (``env.name``) plays one episode per prompt instead and returns its
    transcript: the model's turns and the environment's answers (``_episodes``).

    ``generate(run_dir, prompts, ...) -> list[str]``: completions of the run's
    final model (or a checkpoint), the run's prompt formatting applied; with an
    environment, each prompt's episode (the model's turns and the environment's
    answers).
    """
    from conveyor.data.api import prompt_special_tokens
    from conveyor.launch.preflight import check_devices
    from conveyor.observe.progress import quiet_libraries
    from conveyor.rollout.api import SamplingParams
    cfg = run_config(run_dir)
    check_devices(cfg)
    quiet_libraries()
    if cfg.env.name:
        if raw:
            raise ConfigError(f"--raw: a run with an environment (env.name={cfg.env.name}) writes its episodes' "
                              "turns itself; give the task's prompt without --raw")
        params = SamplingParams.from_config(cfg.rollout, n=1, temperature=temperature, seed=seed,
                                            max_new_tokens=max_new_tokens or cfg.rollout.max_new_tokens)
        return _episodes(_reader_config(cfg), run_dir, prompts, params, checkpoint)
    with _plain_model(run_dir, checkpoint) as path:
        engine, tok = _engine(cfg, path)
    special = prompt_special_tokens(cfg.data)
    ids = [tok(p if raw else format_prompt(cfg, tok, p), add_special_tokens=special)["input_ids"]
           for p in prompts]
    limit = engine.context_limit - 1
    if any(len(i) > limit for i in ids):
        raise ConfigError(f"a prompt is longer than the model's context ({limit} tokens); shorten it")
    params = SamplingParams.from_config(cfg.rollout, n=1, temperature=temperature, seed=seed,
                                        max_new_tokens=max_new_tokens or cfg.rollout.max_new_tokens)
    try:
        outs = engine.generate([list(i) for i in ids], params)
    finally:
        engine.close()
    return [tok.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]


def evaluate(run_dir: str | Path, overrides: Sequence[str] = (), *,
             checkpoint: str | Path | None = None) -> EvalResult:
    """Held-out reward of the run's model with the run's reward and eval set (overrides apply,
    e.g. ``data.eval_size=500``), greedy and at the rollout temperature.

    ``evaluate(run_dir, overrides=(), checkpoint=None) -> EvalResult``: held-out
    reward of that model with the run's reward and eval set, greedy and sampled.
    """
    import tempfile

    from conveyor.launch.local import LocalLauncher
    from conveyor.launch.preflight import check_devices
    from conveyor.observe.progress import quiet_libraries
    from conveyor.run.session import build
    cfg = run_config(run_dir, overrides)
    cfg = _reader_config(cfg)
    cfg = cfg.model_copy(update={"loop": cfg.loop.model_copy(update={"eval_sampled": True})})
    check_devices(cfg)
    quiet_libraries()
    with tempfile.TemporaryDirectory(prefix="conveyor-eval-") as tmp, \
            _plain_model(run_dir, checkpoint) as path:
        s = build(cfg, Path(tmp), str(path), LocalLauncher(cfg, Path(tmp)))
        try:
            s.start_rollouts(str(path))
            m = s.evaluator.evaluate(0)
        finally:
            s.close()
    return EvalResult.from_metrics(m)


def _reader_config(cfg: RunConfig) -> RunConfig:
    """A run's config for reading its model back (evaluate, an environment's episodes): one engine
    in this process, whatever the run's placement was; no trackers, no timeline of its own."""
    from conveyor.config import LaunchConfig
    return cfg.model_copy(update={"launch": LaunchConfig(timeout_s=cfg.launch.timeout_s),
                                  "observe": cfg.observe.model_copy(update={"tensorboard": False, "progress": False,
                                                                            "sinks": [], "timeline": False})})


# Training tasks searched for a prompt's task after the held-out ones (a synthetic source is endless).
TASKS_SEARCHED = 10_000


def _episodes(cfg: RunConfig, run_dir: str | Path, prompts: Sequence[str], params,
              checkpoint: str | Path | None) -> list[str]:
    """One episode per prompt in the run's environment, played by its model. A prompt's task is the
    run's own task with that prompt (the held-out ones first, then the first ``TASKS_SEARCHED``
    training tasks), so an environment that needs the task's data (guess_number's target) has
    it; a prompt of no task is a task of its own. An episode the environment cannot play is
    refused in one line, with a prompt of the run's data."""
    import itertools
    import tempfile

    from conveyor.env.api import EnvFailure
    from conveyor.launch.local import LocalLauncher
    from conveyor.run.session import build
    from conveyor.types import Task
    with tempfile.TemporaryDirectory(prefix="conveyor-generate-") as tmp, \
            _plain_model(run_dir, checkpoint) as path:
        s = build(cfg, Path(tmp), str(path), LocalLauncher(cfg, Path(tmp)))
        try:
            searched = range(min(len(s.train_source), TASKS_SEARCHED))
            known: dict[str, Task] = {}
            for t in itertools.chain(s.eval_tasks, (s.train_source[i] for i in searched)):
                if t.prompt in prompts:  # the first task of each prompt asked for, no further than needed
                    known.setdefault(t.prompt, t)
                    if len(known) == len(set(prompts)):
                        break
            tasks = [known.get(p, Task(f"generate-{i}", p)) for i, p in enumerate(prompts)]
            example = (s.eval_tasks or [s.train_source[0]])[0].prompt  # a run has trained on its source
            s.start_rollouts(str(path))
            played = s.rollouts.episodes.play_tasks(tasks, params, timeout_s=cfg.launch.timeout_s)
        finally:
            s.close()
        tok = s.tokenizer
    for prompt, ep in zip(prompts, played):
        if isinstance(ep, EnvFailure):
            raise ConfigError(f"the environment (env.name={cfg.env.name}) could not play an episode of {prompt!r} "
                              f"({ep.kind}: {ep}); give a prompt of the run's data, e.g. {example!r}")
    return [tok.decode(ep.completion_ids, skip_special_tokens=True) for ep in played]
