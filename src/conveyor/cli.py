"""The `conveyor` command.

    conveyor train [RECIPE] [key=value ...] [--output-dir DIR]   run RL (default: the built-in recipe)
    conveyor train --resume RUN_DIR [key=value ...]             continue a run from its last checkpoint
    conveyor sft   [RECIPE] [key=value ...]                     only the supervised warm-start
    conveyor export RUN_DIR OUT                                  write a plain HF checkpoint
    conveyor config [RECIPE] [key=value ...]                     print the resolved config
    conveyor build-tiny OUT                                      write the tiny model + tokenizer

Contract: user mistakes (bad recipe, missing file, unknown reward) end with
one line ``conveyor: error: ...`` and exit code 2; anything else is a bug
and keeps its traceback. The CLI knows nothing of training itself.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import logging
import sys
from pathlib import Path

import yaml

from conveyor.config import ConfigError, load_config

# Errors that mean "the user asked for something impossible"; resolved lazily
# so `conveyor config` never imports torch.
_USER_ERRORS = ("ConfigError", "DataError", "PluginError", "SetupError", "RewardError")

DEFAULT_RECIPE = Path(__file__).parent / "recipes" / "default.yaml"


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    recipe = None
    overrides = []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif recipe is None:
            recipe = a
        else:
            raise ConfigError(f"unexpected argument {a!r}: give one recipe file and key=value overrides")
    return recipe, overrides


def _config(args: list[str], output_dir: str | None):
    recipe, overrides = _split(args)
    cfg = load_config(recipe or DEFAULT_RECIPE, overrides)
    if output_dir:
        cfg.output_dir = output_dir
    return cfg


def _run_dir(cfg) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.name}-{stamp}"


def _train(ns) -> int:
    from conveyor.launch.local import run_local
    if ns.resume:
        run_dir = Path(ns.resume)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {run_dir}: no config.yaml there; give a run directory of conveyor train")
        recipe, overrides = _split(ns.args)
        if recipe:
            raise ConfigError("--resume takes the recipe saved in the run directory; pass only key=value overrides")
        base = yaml.safe_load((run_dir / "config.yaml").read_text())
        cfg = load_config(None, overrides, base=base)
        run_local(cfg, run_dir, resume=True)
    else:
        cfg = _config(ns.args, ns.output_dir)
        run_local(cfg, _run_dir(cfg))
    return 0


def _sft(ns) -> int:
    from conveyor.controller.run import build, resolve_model_path, warm_start_phase
    from conveyor.launch.local import LocalLauncher
    cfg = _config(ns.args, ns.output_dir)
    if cfg.sft.steps == 0:
        raise ConfigError("sft.steps is 0: set sft.steps=N to run the warm-start")
    run_dir = _run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = resolve_model_path(cfg, run_dir)
    s = build(cfg, run_dir, base, LocalLauncher(cfg, run_dir))
    try:
        s.start_rollouts(base, 0)
        before = s.evaluator.evaluate(0)["eval_reward"]
        warm = warm_start_phase(s, base)
        after = s.evaluator.evaluate(cfg.sft.steps)["eval_reward"]
        s.logger.message(f"held-out reward {before:.3f} -> {after:.3f}; model in {warm}")
    finally:
        s.close()
    return 0


def _export(ns) -> int:
    from conveyor.controller.run import latest_checkpoint
    from conveyor.trainer.checkpoint import export_hf
    run_dir = Path(ns.run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        if (run_dir / "final" / "config.json").exists():
            ckpt = run_dir / "final"
        else:
            raise ConfigError(f"{run_dir}: no checkpoints/step_* and no final/ model; is this a run directory?")
    export_hf(ckpt, Path(ns.out))
    print(f"wrote {ns.out} from {ckpt}")
    return 0


def _show_config(ns) -> int:
    cfg = _config(ns.args, ns.output_dir)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _build_tiny(ns) -> int:
    from conveyor.data.tiny import build_tiny
    print(build_tiny(ns.out))
    return 0


def _role_failure(e: BaseException) -> BaseException | None:
    """The RoleError behind an exception (a dead or failing role), if any: its message
    already names the role, the exit code or traceback, and the last log lines."""
    while e is not None:
        if type(e).__name__ == "RoleError":
            return e
        e = e.__cause__ or e.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="conveyor", description="streaming RL post-training for LLMs")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("train", _train), ("sft", _sft), ("config", _show_config)):
        sp = sub.add_parser(name)
        sp.add_argument("args", nargs="*", help="RECIPE file and/or key=value overrides")
        sp.add_argument("--output-dir", default=None)
        if name == "train":
            sp.add_argument("--resume", metavar="RUN_DIR", default=None)
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("export")
    sp.add_argument("run_dir")
    sp.add_argument("out")
    sp.set_defaults(fn=_export)
    sp = sub.add_parser("build-tiny")
    sp.add_argument("out")
    sp.set_defaults(fn=_build_tiny)
    # Overrides may come before or after --output-dir / --resume, so positional
    # leftovers are appended to the recipe-and-overrides list.
    ns, extra = p.parse_known_args(argv)
    bad = [a for a in extra if a.startswith("-") or not hasattr(ns, "args")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        ns.args = ns.args + extra
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.fn(ns)
    except Exception as e:  # noqa: BLE001 - only user errors and role failures are shortened
        if type(e).__name__ in _USER_ERRORS or isinstance(e, ConfigError):
            print(f"conveyor: error: {e}", file=sys.stderr)
            return 2
        role = _role_failure(e)
        if role is not None:
            print(f"conveyor: run stopped: {role}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print("conveyor: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
