"""Typed run configuration: one pydantic model per role, composed into RunConfig.

Contract: ``load_config(path, overrides)`` reads a YAML or TOML recipe (or
nothing: the built-in default), applies dotted ``key=value`` overrides, and
validates everything at load time. Unknown keys and wrong types raise
``ConfigError`` whose message names the dotted field and what was expected.
The sections live in ``config/sections.py`` (the reward's in ``config/reward.py``, checked
by the rules of ``config/reward_rules.py``; the advantage estimators' table in
``config/estimators.py``), the recipe machinery in ``config/recipes.py``; this package
re-exports them.
It imports no torch, so the CLI can validate a recipe instantly.
It does not know how a field is used; each role reads its own section.
"""
from __future__ import annotations

from conveyor.config.base import ConfigError
from conveyor.config.recipes import (BUILTIN_BASES, DEFAULT_RECIPE, NO_BASE, PRETRAINED_RECIPE, apply_override,
                                     base_config, config_diff, describe_section, did_you_mean, format_diff,
                                     load_config, read_recipe, recipe_without_file, save_config, sections,
                                     validate)
from conveyor.config.sections import (SINKS, AlgoConfig, DataConfig, EndpointConfig, EnvConfig, JudgeConfig,
                                      LaunchConfig, LoopConfig, ModelConfig, ObserveConfig, RewardComponentConfig,
                                      RewardConfig, RolloutConfig, RunConfig, SFTConfig, TinyModelConfig,
                                      TrainerConfig)

__all__ = ["BUILTIN_BASES", "DEFAULT_RECIPE", "NO_BASE", "PRETRAINED_RECIPE", "SINKS", "AlgoConfig", "ConfigError",
           "DataConfig", "EndpointConfig", "EnvConfig", "JudgeConfig", "LaunchConfig", "LoopConfig", "ModelConfig",
           "ObserveConfig", "RewardComponentConfig", "RewardConfig", "RolloutConfig", "RunConfig", "SFTConfig",
           "TinyModelConfig", "TrainerConfig", "apply_override", "base_config", "config_diff", "describe_section",
           "did_you_mean", "format_diff", "load_config", "read_recipe", "recipe_without_file", "save_config",
           "sections", "validate"]
