"""The errors that stop a run, under one base class, and the error of a run that cannot start.

- ``RunStop``: the base of every error that stops a running run with a message that already says
  why and what to do (``RoleError``, ``NonFiniteLossError``, ``NoLearningSignal``).
- ``SetupError``: a run that cannot start (a ``ValueError``: the user asked for something this
  machine or config cannot give); the message names the thing and the fix.

Nothing here imports anything.
"""
from __future__ import annotations


class RunStop(Exception):
    """An error that stops a running run.

    ``RunStop``: the base of every error that stops a running run with a message that already says
    why and what to do; ``conveyor`` prints it as ``run stopped: <message>`` (``cli._RUN_STOPS``
    matches these classes by name, so an error of a role that crossed a process keeps its meaning).
    - ``RoleError``: a role failed (its process died, it raised, or it did not answer in time); the
      message names the role and says what happened.
    - ``NonFiniteLossError``: a loss or gradient norm was NaN/inf; no optimizer step was taken for
      that mini-batch (the trainer names the step and what to check).
    - ``NoLearningSignal``: dynamic sampling drew a step's whole budget of groups and could not fill
      its batch (``controller.group_filter``).
    """


class RoleError(RunStop, RuntimeError):
    """A role failed; the message names the role and says what happened."""


class NonFiniteLossError(RunStop, FloatingPointError):
    """A loss or gradient norm was NaN/inf; no optimizer step was taken for that mini-batch."""


class NoLearningSignal(RunStop, RuntimeError):
    """Dynamic sampling drew a step's whole budget of groups and could not fill its batch."""


class SetupError(ValueError):
    """A run that cannot start; the message names the thing and the fix."""
