"""A run with every role on this machine.

Contract: ``run_local(cfg, run_dir, resume=False)`` runs ``session.run`` with a
``launch.local.LocalLauncher`` (roles in this process or in child processes, by
``launch.placement``) and returns the run's summary (what ``summary.json`` holds).
"""
from __future__ import annotations

from pathlib import Path

from conveyor.config import RunConfig
from conveyor.launch.local import LocalLauncher
from conveyor.run.session import run

__all__ = ["run_local"]


def run_local(cfg: RunConfig, run_dir: Path, resume: bool = False) -> dict:
    return run(cfg, run_dir, resume, LocalLauncher)
