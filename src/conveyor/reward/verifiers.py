"""The builtin rule-based rewards (``math``, ``exact``, ``format``, ``digits``, ``env``) under their
reward path: ``conveyor/verifiers.py`` defines them (the environments' answer checks share them)
and this module re-exports them, so ``conveyor.reward.verifiers:math_reward`` and the builtin
names keep resolving to the same functions."""
from conveyor.verifiers import (
    DEFAULT_FORMAT_PATTERN,
    env_return,
    exact_match,
    extract_prediction,
    format_reward,
    gold_answer,
    math_reward,
    number_digits,
)

__all__ = ["DEFAULT_FORMAT_PATTERN", "env_return", "exact_match", "extract_prediction", "format_reward",
           "gold_answer", "math_reward", "number_digits"]
