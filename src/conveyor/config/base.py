"""The base of every configuration section, and the error a bad recipe raises."""
from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A recipe or override that cannot be used; the message is one line per problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def did_you_mean(word: str, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
